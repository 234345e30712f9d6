"""Phase timing: barrier and device sync around each phase; phase time = max over ranks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

import torch

from ep_runtime.comm import Comm

R = TypeVar("R")


class PhaseClock:
    """Times one phase on this rank, starting together with every other rank.

    Before: device sync, barrier, device sync (so no rank starts early and no queued GPU work
    leaks in). After: device sync (so the phase's kernels are inside the interval).
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def sync(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def time(self, phase: Callable[[], R]) -> tuple[R, float]:
        """``(phase(), seconds)`` measured from a common start."""
        self.sync()
        self.comm.barrier()
        self.sync()
        start = time.perf_counter()
        result = phase()
        self.sync()
        return result, time.perf_counter() - start


class PhaseRecorder:
    """A layer's ``phase_timer``: times each phase of a forward with ``clock`` (summed over the
    rounds of a chunked forward), so what is timed is exactly what ``EPMoE.forward`` runs."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    def __call__(self, name: str, work: Callable[[], R]) -> R:
        result, seconds = self.clock.time(work)
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        return result


@dataclass(frozen=True)
class PhaseStats:
    """Statistics over iterations of the per-iteration max over ranks, in seconds."""

    median_s: float
    min_s: float
    max_s: float
    iterations: int

    def to_json(self) -> dict:
        return asdict(self)


def max_over_ranks_stats(per_rank: list[list[float]]) -> PhaseStats:
    """``per_rank[r][i]`` = rank r's time at iteration i → stats of ``max_r per_rank[r][i]``."""
    per_iteration = [max(times) for times in zip(*per_rank, strict=True)]
    if not per_iteration:
        return PhaseStats(0.0, 0.0, 0.0, 0)
    return PhaseStats(
        statistics.median(per_iteration), min(per_iteration), max(per_iteration), len(per_iteration)
    )
