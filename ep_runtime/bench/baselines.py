"""Baselines measured in the same run: the communication floor and the experts' roofline.

* ``all_to_all_single`` of exactly the rows the dispatch moves (same splits, same dtype, hidden
  payload only): no packing, no expansion, no metadata. Run in both directions.
* A dense GEMM pair of the same FLOPs as this rank's expert work: ``[M, H]·[H, 2I|I]`` then
  ``[M, I]·[I, H]`` with ``M`` = this rank's valid (token, expert) pairs, no activation (the
  compute floor).
* The time to read the expert weights the experts phase touches at the device's memory rate,
  measured by a copy in the same run (the memory floor, the one that binds at decode, where a
  few tokens per expert make the phase a read of its weights). The report takes the larger of
  the two as the experts' baseline (the roofline).
"""

from __future__ import annotations

import torch

from ep_runtime.bench.metrics import Traffic
from ep_runtime.bench.timing import PhaseClock


def time_all_to_all(
    clock: PhaseClock,
    traffic: Traffic,
    hidden: int,
    dtype: torch.dtype,
    iters: int,
    warmup: int,
    reverse: bool = False,
) -> list[float]:
    """Seconds per iteration of one ``all_to_all_single`` carrying the dispatch's rows
    (``reverse``: the combine direction)."""
    comm = clock.comm
    rank, world = comm.rank, comm.world_size
    send = [traffic.rows[rank][d] for d in range(world)]
    recv = [traffic.rows[s][rank] for s in range(world)]
    if reverse:
        send, recv = recv, send
    inputs = torch.randn(sum(send), hidden, device=comm.device).to(dtype)  # [sum send, H]
    output = torch.empty(sum(recv), hidden, device=comm.device, dtype=dtype)  # [sum recv, H]

    def exchange() -> None:
        comm.all_to_all_single(output, inputs, recv, send)

    return _timed(clock, exchange, iters, warmup)


def time_dense_gemm(
    clock: PhaseClock,
    num_pairs: int,
    hidden: int,
    intermediate: int,
    gated: bool,
    dtype: torch.dtype,
    iters: int,
    warmup: int,
) -> list[float]:
    """Seconds per iteration of two dense GEMMs with this rank's expert FLOPs."""
    device = clock.comm.device
    w13_rows = 2 * intermediate if gated else intermediate
    x = torch.randn(num_pairs, hidden, device=device).to(dtype)  # [M, H]
    w13 = torch.randn(w13_rows, hidden, device=device).to(dtype)  # [2I|I, H]
    w2 = torch.randn(hidden, intermediate, device=device).to(dtype)  # [H, I]

    def gemms() -> torch.Tensor:
        h = x @ w13.T  # [M, 2I|I]
        return h[:, :intermediate] @ w2.T  # [M, H]

    return _timed(clock, gemms, iters, warmup)


COPY_BYTES = (64 << 20, 1 << 30)  # the copy's size is the weights' bytes, clamped to this range


def time_weights_read(clock: PhaseClock, weight_bytes: int, iters: int, warmup: int) -> list[float]:
    """Seconds per iteration to read ``weight_bytes`` at this device's memory rate: a copy of
    ``weight_bytes`` (at least 64 MiB, so the caches do not flatter the rate; at most 1 GiB),
    which reads and writes its size, so the read takes ``time · weight_bytes / (2 · size)``."""
    size = min(max(weight_bytes, COPY_BYTES[0]), COPY_BYTES[1])
    source = torch.ones(size, dtype=torch.uint8, device=clock.comm.device)  # pages touched
    target = torch.empty_like(source)
    times = _timed(clock, lambda: target.copy_(source), iters, warmup)
    return [seconds * weight_bytes / (2 * size) for seconds in times]


def _timed(clock: PhaseClock, phase, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        clock.time(phase)
    return [clock.time(phase)[1] for _ in range(iters)]
