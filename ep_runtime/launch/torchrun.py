"""torchrun / SLURM launcher: this process is one rank; ``env://`` rendezvous, no Ray.

Reads RANK, WORLD_SIZE, LOCAL_RANK (torchrun) or SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
(``srun``), and MASTER_ADDR / MASTER_PORT, which the job script must export. Supervision is the
job runner's (torchrun ends every rank when one fails); the collective timeout keeps a survivor
from waiting forever. Every rank gets every summary; rank 0 prints and writes the report.

Rendezvous: under torchrun the ranks join the store torchrun's agent hosts (``env://``; torch
binds it). Otherwise rank 0 hosts the store itself (``rendezvous``): on loopback, with gloo and
NCCL on loopback too, when every rank runs on this host; on the address MASTER_ADDR names, which
must be one of rank 0's host, on a run across hosts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ep_runtime.launch.network import interface_holding
from ep_runtime.launch.progress import ProgressFactory
from ep_runtime.launch.rank import RankWorker, plan, run_plan
from ep_runtime.launch.rendezvous import LOOPBACK, host_store, join_store
from ep_runtime.launch.spec import LaunchError, RunSpec, resolve_device


@dataclass(frozen=True)
class EnvRank:
    rank: int
    world_size: int
    local_rank: int


def env_rank(environ: dict[str, str] | None = None) -> EnvRank:
    """This process's place, from torchrun's variables or else SLURM's."""
    env = os.environ if environ is None else environ
    for rank_key, world_key, local_key in (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        if rank_key in env and world_key in env:
            return EnvRank(int(env[rank_key]), int(env[world_key]), int(env.get(local_key, 0)))
    raise LaunchError(
        "--launcher torchrun: set RANK and WORLD_SIZE (torchrun does) or run under srun "
        "(SLURM_PROCID, SLURM_NTASKS)"
    )


def is_torchrun_env() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_with_env(
    spec: RunSpec, progress_factory: ProgressFactory
) -> tuple[RunSpec, list[dict], int]:
    """Run this rank; returns the resolved spec, every rank's summary and this rank's id."""
    place = env_rank()
    if place.world_size != spec.world_size:
        raise RuntimeError(
            f"WORLD_SIZE={place.world_size} but the run was built for {spec.world_size}"
        )
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise LaunchError(f"--launcher torchrun: {key} must be set (env:// rendezvous)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = resolve_device(spec.device, 1, gpus, "this node")  # GPU LOCAL_RANK for this rank
    spec = dataclasses.replace(spec, device=device)
    single = single_host(place, os.environ)
    store = rendezvous_store(place, single, spec.timeout_s, os.environ)
    worker = RankWorker(spec, place.rank, place.local_rank, LOOPBACK if single else None)
    if store is None:
        worker.init_process_group(init_method="env://")
    else:
        worker.init_process_group(store=store)
    steps = plan(spec)
    if place.rank == 0:
        with progress_factory(steps) as progress:
            summary = run_plan(worker, progress.done)
    else:
        summary = run_plan(worker)
    summaries = worker.comm.all_gather_object(summary)
    worker.shutdown()
    return spec, summaries, place.rank


def single_host(place: EnvRank, environ: Mapping[str, str]) -> bool:
    """Whether every rank runs on this host: torchrun's LOCAL_WORLD_SIZE is the world size,
    srun's job has one node, or MASTER_ADDR is a loopback address."""
    if environ.get("LOCAL_WORLD_SIZE") == str(place.world_size):
        return True
    if environ.get("SLURM_NNODES", environ.get("SLURM_JOB_NUM_NODES")) == "1":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(environ["MASTER_ADDR"]).is_loopback
    return environ["MASTER_ADDR"] == "localhost"


def rendezvous_store(
    place: EnvRank, single: bool, timeout_s: float, environ: Mapping[str, str]
) -> dist.Store | None:
    """The store this rank joins (rank 0: hosts), or ``None`` under torchrun's agent store."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None  # torchrun's agent hosts it at MASTER_ADDR:MASTER_PORT
    port = int(environ["MASTER_PORT"])
    if place.rank != 0:
        return join_store(
            LOOPBACK if single else environ["MASTER_ADDR"], port, place.world_size, timeout_s
        )
    host = LOOPBACK if single else own_address(environ["MASTER_ADDR"])
    return host_store(host, place.world_size, timeout_s, port=port)


def own_address(master_addr: str) -> str:
    """The address of this host that ``master_addr`` resolves to (not loopback: the other hosts
    could not reach it); rank 0's store listens there only."""
    resolved = {
        info[4][0] for info in socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    }
    for address in sorted(resolved):
        if not ipaddress.ip_address(address.split("%")[0]).is_loopback and interface_holding(
            address
        ):
            return address
    raise LaunchError(
        f"--launcher torchrun: MASTER_ADDR={master_addr} resolves to {sorted(resolved)} on rank "
        "0, none of them a non-loopback address of this host; rank 0 hosts the store there: "
        "set MASTER_ADDR to the IP address the other hosts reach rank 0 by"
    )
