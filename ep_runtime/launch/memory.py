"""Will the ranks fit? An estimate of each rank's memory from the options alone (weights,
inputs, the forward's buffers), checked against what this machine has before any rank starts,
so a run that cannot fit is one line (exit 2), not an allocator traceback (or the kernel's OOM
killer) minutes later.

The estimate is what the default backends hold at once in a forward (the all-to-all's send and
receive rows, the grouped GEMMs' rows: GEMM1's [P, 2I|I], the activation [P, I], GEMM2's
[P, H]); the reference experts, one expert at a time, need less, a backend's own buffers more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ep_runtime.launch.layer_data import shard_weight_bytes
from ep_runtime.launch.presets import ModelPreset

FP32, INDEX = 4, 4  # router logits and weights are fp32; ids int32


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs at least."""

    weights: int  # its expert shard
    inputs: int  # x [T, H], ids and weights [T, K], the router logits [T, E] it routes from
    buffers: int  # rows sent and received [R, H] each, the experts' rows, the output [T, H]

    @property
    def total(self) -> int:
        return self.weights + self.inputs + self.buffers

    def describe(self) -> str:
        return (
            f"weights {_bytes(self.weights)}, inputs {_bytes(self.inputs)}, "
            f"buffers {_bytes(self.buffers)}"
        )


def layer_estimate(
    model: ModelPreset,
    world_size: int,
    dtype: torch.dtype,
    mode: str,
    tokens: int | None = None,
    num_redundant: int = 0,
) -> MemoryEstimate:
    """A rank's estimate for ``model`` at ``tokens`` per rank (default: the preset's).

    Rows R: a token reaches at most min(K, W) ranks, so a rank sends and receives T·min(K, W)
    rows on average; (token, expert) pairs P: T·K on average. Capacity mode holds the static
    worst case: T rows from each of the W ranks, each with up to min(K, E/W) local experts."""
    tokens = model.tokens_per_rank if tokens is None else tokens
    config = model.moe_config(dtype)
    size, hidden, inter = dtype.itemsize, model.hidden_size, model.intermediate_size
    local = (model.num_experts + num_redundant) // world_size  # expert slots per rank
    if mode == "capacity":
        rows, pairs = tokens * world_size, tokens * world_size * min(model.top_k, local)
    else:
        rows, pairs = tokens * min(model.top_k, world_size), tokens * model.top_k
    return MemoryEstimate(
        weights=shard_weight_bytes(config, world_size, dtype, num_redundant),
        inputs=tokens * (hidden * size + model.top_k * (INDEX + FP32) + model.num_experts * FP32),
        buffers=(2 * rows * hidden + pairs * (config.w13_rows + inter + hidden) + tokens * hidden)
        * size,
    )


def available_bytes(device: str) -> tuple[int, str] | None:
    """What a rank can use here and where: the host's available memory (MemAvailable) for CPU
    ranks, the least free memory of the visible GPUs for CUDA ranks; None if unknown."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        free = min(torch.cuda.mem_get_info(d)[0] for d in range(torch.cuda.device_count()))
        return free, "free on a GPU"
    try:  # Linux: free memory plus what the kernel can reclaim (the page cache)
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024, "available on this host"
    except (OSError, KeyError, ValueError):
        pass
    try:  # elsewhere: free pages only (a stricter figure)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free on this host"
    except (AttributeError, OSError, ValueError):
        return None


def check_fits(
    model: ModelPreset,
    world_size: int,
    dtype: torch.dtype,
    mode: str,
    device: str,
    ranks_here: int,
    num_redundant: int = 0,
) -> None:
    """``ValueError`` (one line naming the option, the estimate and what the machine has) when
    the ranks on this machine cannot fit: CPU ranks share the host's memory, CUDA ranks have a
    GPU each."""
    have = available_bytes(device)
    if have is None:
        return
    available, where = have
    sharing = ranks_here if device == "cpu" else 1
    need = layer_estimate(model, world_size, dtype, mode, num_redundant=num_redundant)
    if need.total * sharing <= available:
        return
    who = f"{sharing} ranks need about {sharing} × " if sharing > 1 else "a rank needs about "
    found = f"{who}{_bytes(need.total)} ({need.describe()}), {_bytes(available)} {where}"
    one = layer_estimate(model, world_size, dtype, mode, tokens=1, num_redundant=num_redundant)
    per_token = one.total - need.weights
    fitting = (available // sharing - need.weights) // per_token
    if fitting >= 1 and need.total - need.weights > need.weights:
        raise ValueError(
            f"--tokens: expected at most {fitting} tokens per rank to fit in memory, "
            f"given {model.tokens_per_rank}: {found}"
        )
    more = "; more ranks (--dp) split the experts" if device == "cuda" else ""
    raise ValueError(
        f"--model: expected a model whose expert shard fits in memory, given {model.name} "
        f"(E={model.num_experts} H={model.hidden_size} I={model.intermediate_size}): {found}{more}"
    )


def _bytes(count: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} B"
