"""Rank side of the exact-mode round tests: run a forward, count its rounds (the dispatches the
layer's phase timer sees) and compare the output with ``reference_moe`` per token."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from ep_runtime import reference_moe, rounds
from ep_runtime.tolerance import Comparison, compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import CaseSpec, build_layer, device, make_inputs, make_weights

T = TypeVar("T")


@dataclass(frozen=True)
class RoundsResult:
    rank: int
    rounds: int  # dispatches in the forward
    tokens_per_round: int  # this rank's own bound for its tokens
    comparison: Comparison
    settings: dict[str, str]


def run_rounds_case(spec: CaseSpec, free_tokens: tuple[int | None, ...] | None) -> RoundsResult:
    """One forward of ``spec`` on this rank. ``free_tokens[rank]``: a stand-in for CUDA's free
    memory, as many bytes as that many tokens' buffers need (``rounds.MEMORY_FRACTION`` of it
    used), read as the real one is; ``None``: the real reader (None on CPU: no bound)."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    w13, w2 = make_weights(spec)
    ref, scale = reference_moe(x, ids, weights, w13, w2, spec.activation, return_scale=True)
    layer = build_layer(spec)
    real_reader, real_floor = rounds.free_device_bytes, rounds.QUERY_ABOVE_BYTES
    own = None if free_tokens is None else free_tokens[rank]
    if own is not None:
        per_token = layer.rounds.bytes_per_token
        rounds.free_device_bytes = lambda _device: int(own * per_token / rounds.MEMORY_FRACTION)
        rounds.QUERY_ABOVE_BYTES = 0
    dispatches = 0

    def count(name: str) -> contextlib.nullcontext:
        nonlocal dispatches
        dispatches += name == "dispatch"
        return contextlib.nullcontext()

    try:
        layer.phase_timer = count
        dev = device()
        out = layer(x.to(dev), ids.to(dev), weights.to(dev))
        comparison = compare_per_token(
            out, ref, tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate)), scale
        )
        return RoundsResult(
            rank,
            dispatches,
            layer.rounds.tokens_per_round(x.size(0)),
            comparison,
            layer.spec.settings(),
        )
    finally:
        rounds.free_device_bytes, rounds.QUERY_ABOVE_BYTES = real_reader, real_floor
        layer.close()
