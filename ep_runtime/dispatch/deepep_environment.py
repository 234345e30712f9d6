"""The process environment DeepEP V2 reads: how many SMs its kernels take, and whether NCCL GIN is
used (``EP_DISABLE_GIN``, read by DeepEP when a buffer is built).

The GIN decision needs every rank's view (hosts, GIN support, the variable's value), so it is made
from one all-gather and every rank writes the same value into its ``os.environ``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ep_runtime.comm import Comm
from ep_runtime.dispatch.nccl_probe import GinQuery, query_gin

# DeepEP's SM auto-detection falls to 4 SMs when `nvidia-smi nvlink -s` fails (containers).
# 24 is DeepEP's README "min #SM" row for EP8 (643/675 GB/s on SM100).
DEFAULT_NUM_SMS = 24
NUM_SMS_ENV = "EP_RUNTIME_DEEPEP_NUM_SMS"
DISABLE_GIN_ENV = "EP_DISABLE_GIN"


def default_num_sms(device: torch.device) -> int:
    """SMs for DeepEP's kernels: ``$EP_RUNTIME_DEEPEP_NUM_SMS``, else 24 (even, <= the device's)."""
    if NUM_SMS_ENV in os.environ:
        return int(os.environ[NUM_SMS_ENV])
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    device_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(DEFAULT_NUM_SMS, device_sms - device_sms % 2)


@dataclass(frozen=True)
class RankGin:
    """What one rank contributes to the GIN decision."""

    host: str
    gin: GinQuery
    disable_gin_env: str | None


def must_disable_gin(ranks: Sequence[RankGin]) -> bool:
    """Whether to set ``EP_DISABLE_GIN=1``; every rank sees the same ``ranks``, so decides alike.

    DeepEP asserts GIN for a group unless ``EP_DISABLE_GIN=1``: on one NVLink node going without
    it is fine (DeepEP#630); across nodes there is no path between them without GIN.
    """
    num_hosts = len({rank.host for rank in ranks})
    settings = {rank.disable_gin_env for rank in ranks}
    if len(settings) > 1:
        raise RuntimeError(
            f"{DISABLE_GIN_ENV} differs across ranks ({sorted(map(str, settings))}); "
            "DeepEP V2 needs the same value on every rank"
        )
    if settings == {"1"}:
        if num_hosts > 1:
            raise RuntimeError(
                f"{DISABLE_GIN_ENV}=1 is set, but the group spans {num_hosts} hosts: "
                "DeepEP V2 reaches other nodes only through NCCL GIN"
            )
        return True
    missing = [index for index, rank in enumerate(ranks) if not rank.gin.available]
    if not missing:
        return False
    if num_hosts == 1:
        return True
    first = missing[0]
    raise RuntimeError(
        f"DeepEP V2 across {num_hosts} hosts needs NCCL GIN on every rank; rank {first} "
        f"({ranks[first].host}): {ranks[first].gin.describe()}. GIN needs IBGDA-capable NICs "
        "(MLNX_OFED with libmlx5 >= MLX5_1.25, DeepEP#628) and NCCL >= 2.30.4"
    )


def prepare_gin(comm: Comm) -> str:
    """Probe GIN on every rank of the (warmed, NCCL) group; set ``EP_DISABLE_GIN=1`` on all of
    them on a single node without GIN, raise across nodes without it. Returns what was decided."""
    if comm.group is None or "nccl" not in comm.backend:
        return f"GIN not probed (group backend {comm.backend})"
    own = RankGin(socket.gethostname(), query_gin(comm.group), os.environ.get(DISABLE_GIN_ENV))
    ranks = comm.all_gather_object(own)
    if must_disable_gin(ranks):
        os.environ[DISABLE_GIN_ENV] = "1"
        return f"{own.gin.describe()}; single node: {DISABLE_GIN_ENV}=1 on every rank (NVLink)"
    return own.gin.describe()
