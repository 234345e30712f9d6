"""How ``python -m ep_runtime.bench.hf`` times its rows: interleaved medians, the host's time to
issue one MoE block forward, and the check that every row's model fits on the device at once."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from ep_runtime.bench.timing import sync
from ep_runtime.rounds import free_device_bytes

Timed = tuple[Callable[[], object], Callable[[], object]]  # (untimed set-up, the timed call)


def interleaved_medians(
    runs: dict[str, Timed], device: torch.device, iters: int, warmup: int
) -> dict[str, float]:
    """Median wall time of each row's timed call over ``iters`` calls after ``warmup`` calls,
    synchronised, its set-up run (untimed) before each. The calls are interleaved (one of each
    per round), so a slow spell of a shared host or GPU lands on every row alike instead of on
    whichever row it met."""
    for prepare, run in runs.values():
        prepare()
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, (prepare, run) in runs.items():
            prepare()
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


class BlockHostClock:
    """Host time inside the MoE blocks' forwards, per block forward: the host's time to issue a
    block's work (router, routing, experts, shared experts). The clock adds no device sync, so
    this is an upper bound on the issue time: it includes any wait the block makes itself
    (transformers' ``eager`` experts read their expert counts on the host) and any wait on a
    full launch queue where the GPU is the limit."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        self.blocks = blocks
        self.seconds = 0.0
        self.calls = 0
        self._started = 0.0
        self._handles: list[RemovableHandle] = []

    def _before(self, *_: object) -> None:
        self._started = time.perf_counter()

    def _after(self, *_: object) -> None:
        self.seconds += time.perf_counter() - self._started
        self.calls += 1

    def __enter__(self) -> BlockHostClock:
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._before))
            self._handles.append(block.register_forward_hook(self._after))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def microseconds_per_forward(self) -> float:
        return self.seconds / max(self.calls, 1) * 1e6


@dataclass
class Contender:
    """One row of the table: a model as it runs (transformers' blocks with one experts
    implementation, or patched), its MoE blocks, and whether it takes the prefill."""

    name: str
    model: torch.nn.Module
    blocks: list[torch.nn.Module]
    prefill: bool = True
    experts_implementation: str | None = None  # transformers' own blocks: set before each call

    def prepare(self) -> None:
        """Untimed, before each call: transformers' rows share one model, switched here."""
        if self.experts_implementation is not None:
            self.model.set_experts_implementation(self.experts_implementation)

    def timed(self, run: Callable[[torch.nn.Module], object]) -> Timed:
        return self.prepare, lambda: run(self.model)


def check_room_for_rows(model: torch.nn.Module, rows: int, device: torch.device) -> None:
    """Every patched row holds its own copy of the model at once (the timings are interleaved):
    exit naming the figures where ``rows`` more copies cannot fit in the device's free memory."""
    free = free_device_bytes(device)
    needed = rows * sum(p.numel() * p.element_size() for p in model.parameters())
    if free is not None and needed > free:
        raise SystemExit(
            f"bench.hf: {rows} patched rows hold a model each, {needed / 2**30:.1f} GiB, and "
            f"{free / 2**30:.1f} GiB of {device} is free: use fewer --layers, or drop rows "
            "(--tuned-max-tokens 0, --no-graphs)"
        )
