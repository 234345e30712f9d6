"""Timing: phases across ranks (barrier and device sync around each phase; phase time = max over
ranks), and on one GPU the helpers every single-device bench shares (CUDA-event medians, the
device-to-device copy rate, the kernels a call launches)."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch

from ep_runtime.comm import Comm

R = TypeVar("R")


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseClock:
    """Times one phase on this rank, starting together with every other rank.

    Before: device sync, barrier, device sync (so no rank starts early and no queued GPU work
    leaks in). After: device sync (so the phase's kernels are inside the interval).
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def sync(self) -> None:
        sync(self.comm.device)

    def start(self) -> float:
        """The common start: every rank's queued work done, then together."""
        self.sync()
        self.comm.barrier()
        self.sync()
        return time.perf_counter()

    def seconds_since(self, start: float) -> float:
        """Seconds from ``start`` to this rank's queued work done."""
        self.sync()
        return time.perf_counter() - start

    def time(self, phase: Callable[[], R]) -> tuple[R, float]:
        """``(phase(), seconds)`` measured from a common start."""
        start = self.start()
        result = phase()
        return result, self.seconds_since(start)


class PhaseRecorder:
    """A layer's ``phase_timer``: ``with recorder(name):`` times each phase of a forward as
    ``PhaseClock.time`` does (summed over the rounds of a chunked forward), so what is timed is
    exactly what ``EPMoE.forward`` runs."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = self.clock.start()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + self.clock.seconds_since(start)


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


# one GPU ------------------------------------------------------------------------------------
def time_ms(work: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median of ``iters`` CUDA-event timings of ``work``."""
    for _ in range(warmup):
        work()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def back_to_back_ms(work: Callable[[], object], calls: int = 20) -> tuple[float, float]:
    """``(device ms, host ms)`` per call of ``calls`` calls of ``work`` issued without a sync
    between them, as a model's layers are (one window): the device figure spans an event
    recorded before the first call's host work to one after the last call's kernels, so the
    host's lead before the first kernel counts once over the ``calls``; the host figure is the
    time to issue one. ``work`` should be warm (compiled, buffers sized)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host_start = time.perf_counter()
    for _ in range(calls):
        work()
    host_ms = (time.perf_counter() - host_start) * 1e3 / calls
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, host_ms


def device_ms(work: Callable[[], object], iters: int = 10, flush_bytes: int = 256 << 20) -> float:
    """Device time of one ``work()`` with a cold L2: a CUDA graph of several calls, each after
    a ``flush_bytes`` write that evicts L2 (so the weights come from HBM, as a model's next
    layer reads its own), less a graph of the writes alone. Unlike an event-timed single call
    it excludes the host's launch cost, which at decode is larger than the kernel."""
    rough_ms = time_ms(work, iters=3, warmup=2)  # compiles and warms ``work`` before capture
    reps = max(1, min(50, math.ceil(2.0 / max(rough_ms, 1e-3))))
    scratch = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")

    def captured(with_work: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                scratch.zero_()
                if with_work:
                    work()
        return graph

    both, flushes = captured(True), captured(False)
    return (time_ms(both.replay, iters) - time_ms(flushes.replay, iters)) / reps


def graph_replay_ms(
    forward: Callable[[], torch.Tensor], eager_out: torch.Tensor, forwards: int = 1
) -> float:
    """Time per forward of a CUDA graph of ``forwards`` back-to-back calls of ``forward`` (a
    capacity-mode layer call, warmed on a side stream first), each call's output checked
    bitwise equal to ``eager_out``. With one forward the figure includes the graph's launch
    latency (the device idles from the start event until the host's submit arrives); several
    share it, as the layers of a captured model do."""
    device = eager_out.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = [forward() for _ in range(forwards)]
    graph.replay()
    torch.cuda.synchronize()
    if not all(torch.equal(out, eager_out) for out in graph_outs):
        raise AssertionError("the CUDA graph's output differs from the eager forward's")
    return time_ms(graph.replay) / forwards


def copy_rate_bytes_per_ms(device: torch.device) -> float:
    """Bytes read + written per ms by a 2 GiB device-to-device copy."""
    source = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source), iters=10)
    return 2 * source.numel() / ms


@dataclass(frozen=True)
class DeviceActivity:
    """What one call put on the GPU, by name: kernels, and memcpy / memset operations."""

    kernels: dict[str, int]
    copies: dict[str, int]

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())

    @property
    def num_copies(self) -> int:
        return sum(self.copies.values())


def device_activity(work: Callable[[], object]) -> DeviceActivity:
    """The kernels and copies one call of ``work`` puts on the GPU (torch.profiler's trace)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        work()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:  # the trace's "cat" says what ran on the GPU
        trace = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e["name"] for e in events if e.get("cat") == "kernel"]
    copies = [e["name"] for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    return DeviceActivity(dict(Counter(kernels)), dict(Counter(copies)))
