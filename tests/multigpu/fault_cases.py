"""Rank-side fault injection for the failure-protocol tests: one rank misbehaves as a user's
application would make it, every rank reports how its own forward ended and how long it took,
and (where the group can go on) whether the next forward matches ``reference_moe``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ep_runtime import reference_moe
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import CaseSpec, build_layer, device, make_inputs, make_weights

INJECTED = "injected failure in the experts (as an out-of-memory error would be)"
MISMATCHED_SETTINGS = {
    "hidden": 64,
    "dtype": torch.float32,
    "mode": None,  # the other mode
    "cap": 8,
}


@dataclass(frozen=True)
class Reaction:
    """How one rank's call ended."""

    rank: int
    error_type: str  # "none" when it returned
    message: str
    seconds: float
    next_forward_ok: bool | None = None  # the forward after, vs the oracle (None: not run)


def _attempt(call: Callable[[], object]) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
    except BaseException as error:  # every kind of ending is reported to the driver
        return type(error).__name__, str(error), time.monotonic() - start
    return "none", "", time.monotonic() - start


def _inputs(spec: CaseSpec, seed: int):
    rank = dist.get_rank()
    x, ids, weights = make_inputs(replace(spec, seed=seed), rank)
    return x, ids, weights


def _forward_matches_reference(layer, spec: CaseSpec, seed: int) -> bool:
    x, ids, weights = _inputs(spec, seed)
    w13, w2 = make_weights(spec)
    ref, scale = reference_moe(x, ids, weights, w13, w2, spec.activation, return_scale=True)
    dev = device()
    out = layer(x.to(dev), ids.to(dev), weights.to(dev))
    layer.check()
    tolerance = tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate))
    return compare_per_token(out, ref, tolerance, scale).passed


def _forward(layer, spec: CaseSpec, seed: int) -> Callable[[], object]:
    dev = device()
    x, ids, weights = (t.to(dev) for t in _inputs(spec, seed))

    def run() -> None:
        layer(x, ids, weights)
        layer.check()  # capacity mode on CUDA reports here

    return run


def experts_fail_mid_forward(spec: CaseSpec, bad_rank: int) -> Reaction:
    """``bad_rank``'s experts raise after dispatch; the application catches the error and runs
    the next forward."""
    rank = dist.get_rank()
    layer = build_layer(spec)
    try:
        if rank == bad_rank:
            real_forward = layer.experts.forward

            def failing_once(dispatched):
                layer.experts.forward = real_forward
                raise RuntimeError(INJECTED)

            layer.experts.forward = failing_once
        ended = _attempt(_forward(layer, spec, seed=1))
        next_ok = _forward_matches_reference(layer, spec, seed=2)
        return Reaction(rank, *ended, next_forward_ok=next_ok)
    finally:
        layer.close()


def built_with_other_setting(spec: CaseSpec, bad_rank: int, setting: str) -> Reaction:
    """``bad_rank`` builds its layer with another ``setting``; afterwards all build alike."""
    rank = dist.get_rank()
    own = spec
    if rank == bad_rank:
        value = MISMATCHED_SETTINGS[setting]
        if setting == "mode":
            value = "capacity" if spec.mode == "exact" else "exact"
        own = replace(spec, **{setting: value})
    built = []
    ended = _attempt(lambda: built.append(build_layer(own)))
    for layer in built:
        layer.close()
    layer = build_layer(spec)
    try:
        return Reaction(rank, *ended, next_forward_ok=_forward_matches_reference(layer, spec, 3))
    finally:
        layer.close()


def skips_a_layer(spec: CaseSpec, bad_rank: int, how: str) -> Reaction:
    """A model of two MoE layers. In its first step ``bad_rank`` leaves out layer 0: it skips
    it, or its application raises (and catches) before calling it, and goes on to layer 1,
    which meets the others' layer 0. Every rank's step fails; the next step is correct."""
    rank = dist.get_rank()
    layers = [build_layer(spec), build_layer(spec)]
    try:
        first_step = layers if rank != bad_rank else layers[1:]

        def step() -> None:
            if rank == bad_rank and how == "app_exception":
                _attempt(lambda: (_ for _ in ()).throw(RuntimeError("the application failed")))
            for layer in first_step:
                _forward(layer, spec, seed=1)()

        ended = _attempt(step)
        next_ok = all(_forward_matches_reference(layer, spec, seed=2) for layer in layers)
        return Reaction(rank, *ended, next_forward_ok=next_ok)
    finally:
        for layer in layers:
            layer.close()


def skips_a_forward_of_one_layer(spec: CaseSpec, bad_rank: int) -> list[Reaction]:
    """One layer; ``bad_rank`` runs one forward fewer than the others, then closes it. Forwards
    of one layer are interchangeable (each rank's output depends only on its own tokens), so
    every forward that pairs must be correct, and the one left over must fail, naming the rank
    that closed, instead of waiting."""
    rank = dist.get_rank()
    layer = build_layer(spec)
    forwards = 2 if rank == bad_rank else 3
    reactions = []
    try:
        for seed in range(forwards):
            start = time.monotonic()
            try:
                ok = _forward_matches_reference(layer, spec, seed)
                reactions.append(Reaction(rank, "none", "", time.monotonic() - start, ok))
            except Exception as error:
                elapsed = time.monotonic() - start
                reactions.append(Reaction(rank, type(error).__name__, str(error), elapsed))
    finally:
        layer.close()
    return reactions


def closes_then_forwards(spec: CaseSpec, bad_rank: int) -> Reaction:
    """``bad_rank`` closes its layer, then calls its forward; the others call theirs. The group
    is out of step afterwards (the driver discards the pool)."""
    rank = dist.get_rank()
    layer = build_layer(spec)
    try:
        if rank == bad_rank:
            layer.close()
        return Reaction(rank, *_attempt(_forward(layer, spec, seed=1)))
    finally:
        layer.close()


@dataclass(frozen=True)
class DeviceRecorded:
    """Capacity mode with checks on the device: how the forward ended, whether its output was
    all NaN, and what ``check()`` raised afterwards."""

    rank: int
    forward_error: str
    output_all_nan: bool | None
    check_error: str
    check_message: str
    next_forward_ok: bool


def fails_with_checks_on_device(spec: CaseSpec, bad_rank: int, fault: str) -> DeviceRecorded:
    """``bad_rank``'s experts raise mid-forward (``experts``), or it passes x of the wrong width
    (``input``), or skips layer 0 of two (``layer``); nobody reads the headers on the host."""
    rank = dist.get_rank()
    layers = [build_layer(spec), build_layer(spec)]
    dev = device()
    x, ids, weights = (t.to(dev) for t in _inputs(spec, seed=1))
    try:
        target = layers[0]
        if rank == bad_rank and fault == "experts":
            real_forward = target.experts.forward

            def failing_once(dispatched):
                target.experts.forward = real_forward
                raise RuntimeError(INJECTED)

            target.experts.forward = failing_once
        if rank == bad_rank and fault == "input":
            x = torch.zeros(x.size(0), spec.hidden + 8, dtype=x.dtype, device=dev)
        if rank == bad_rank and fault == "layer":
            target = layers[1]
        outputs = []
        forward_error = _attempt(lambda: outputs.append(target(x, ids, weights)))[0]
        all_nan = bool(torch.isnan(outputs[0]).all()) if outputs else None
        check_error, check_message, _ = _attempt(target.check)
        if fault == "layer":  # the other layer was recorded on the same dispatcher
            _attempt(layers[1 - layers.index(target)].check)
        next_ok = all(_forward_matches_reference(layer, spec, seed=2) for layer in layers)
        return DeviceRecorded(rank, forward_error, all_nan, check_error, check_message, next_ok)
    finally:
        for layer in layers:
            layer.close()


def timed_bad_input(spec: CaseSpec, bad_rank: int, fault: str) -> tuple[str, str, float]:
    """Rank ``bad_rank`` passes bad input; every rank returns (error type, message, seconds)."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    layer = build_layer(spec)
    if rank == bad_rank:
        if fault == "id_out_of_range":
            ids = ids.clone()
            ids[0, 0] = spec.num_experts + 3
        elif fault == "wrong_hidden":
            x = torch.zeros(x.size(0), spec.hidden + 1, dtype=spec.dtype)
        elif fault == "too_many_tokens":
            x, ids, weights = (t.repeat(spec.cap + 1, 1)[: spec.cap + 1] for t in (x, ids, weights))
    dev = device()
    start = time.monotonic()
    try:
        layer(x.to(dev), ids.to(dev), weights.to(dev))
        layer.check()  # capacity mode on CUDA defers errors to here (no host sync in forward)
        return ("none", "", time.monotonic() - start)
    except Exception as error:
        return (type(error).__name__, str(error), time.monotonic() - start)
    finally:
        layer.close()
