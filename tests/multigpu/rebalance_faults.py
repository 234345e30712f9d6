"""Rank-side fault injection into a placement change (``layer.rebalance()``, eplb/transaction.py):
one rank fails a step (an exception in planning, packing, the exchange before or after its
collective, staging, the backend reload), skips the call, rebalances another layer, passes
another load or is SIGKILLed as it enters one of the change's collectives; every (surviving) rank
reports how its call ended and how long it took, what placement and slot weights it holds
afterwards, and whether the next forward matches ``reference_moe``."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ep_runtime import EPMoE, reference_moe
from ep_runtime.eplb import rebalanced_placement
from ep_runtime.eplb.transaction import PlacementChange
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.fault_cases import _attempt
from tests.multigpu.rank_inputs import CaseSpec, build_layer, device, make_weights, skewed_inputs

INJECTED = "injected failure in a placement change (as an out-of-memory error would be)"
# the local steps of PlacementChange an exception is injected into (docs of each in the module)
FAILING_STEPS = ("plan", "pack", "allocate", "unpack", "stage", "reload")
ELSEWHERE = ("skip", "other_layer", "other_load")
IN_PLACE = ("pack", "unpack", "stage", "skip")  # faults run where the commit writes in place
# where a killed rank dies: as it enters each collective of the change, or after its vote
KILL_POINTS = ("open", "sum_load", "agree", "exchange", "vote", "after_vote")


@dataclass(frozen=True)
class Outcome:
    """One rank's view after the faulty rebalance."""

    rank: int
    error_type: str  # "none" when it returned
    message: str
    seconds: float
    fingerprint: str  # of the placement it holds afterwards
    initial: bool  # that placement is the one the layer was built with
    slots_hold_their_experts: bool  # every slot's weights bitwise its expert's
    next_forward_ok: bool
    clean_rebalance_moved: bool  # a rebalance after the failed one changed the placement
    in_place: bool  # the faulty change was staged for an in-place commit (the layer's own weights)


def forward_matches(layer: EPMoE, spec: CaseSpec, seed: int) -> bool:
    x, ids, weights = skewed_inputs(spec, seed)
    w13, w2 = make_weights(spec)
    ref, scale = reference_moe(x, ids, weights, w13, w2, spec.activation, return_scale=True)
    dev = device()
    out = layer(x.to(dev), ids.to(dev), weights.to(dev))
    layer.check()
    tolerance = tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate))
    return compare_per_token(out, ref, tolerance, scale).passed


def slots_hold_their_experts(layer: EPMoE, spec: CaseSpec) -> bool:
    """Every slot of this rank holds, bitwise, the expert its placement names."""
    w13, w2 = make_weights(spec)
    slot13, slot2 = layer.eplb.slot_weights
    experts = layer.placement.experts_on_rank(dist.get_rank())
    return all(
        torch.equal(slot13[local].cpu(), w13[expert].to(slot13.dtype))
        and torch.equal(slot2[local].cpu(), w2[expert].to(slot2.dtype))
        for local, expert in enumerate(experts)
    )


def _failing(step: str):
    def fail(*args, **kwargs):
        raise RuntimeError(INJECTED)

    return fail


def faulty_rebalance(spec: CaseSpec, redundant: int, bad_rank: int, fault: str) -> Outcome:
    """A forward, then a rebalance in which ``bad_rank`` misbehaves (``fault``: a step of
    ``FAILING_STEPS`` raises, or one of ``ELSEWHERE``); then a forward and a clean rebalance."""
    rank = dist.get_rank()
    given = torch.float32 if fault in IN_PLACE else None
    layers = [build_layer(spec, redundant, given=given), build_layer(spec, redundant, given=given)]
    layer = layers[0]
    try:
        forward_matches(layer, spec, seed=1)
        initial = layer.placement
        in_place = layer.eplb.owns_weights
        step = "_staged_experts" if fault == "reload" else fault
        owner = layer if fault == "reload" else PlacementChange
        real = getattr(owner, step, None) if fault in FAILING_STEPS else None
        load = None
        if rank == bad_rank and fault in FAILING_STEPS:
            setattr(owner, step, _failing(step))
        if rank == bad_rank and fault == "other_load":
            load = torch.arange(spec.num_experts, dtype=torch.float64) ** 2
        if rank == bad_rank and fault == "skip":
            ended = _attempt(lambda: forward_matches(layer, spec, seed=2))
        elif rank == bad_rank and fault == "other_layer":
            ended = _attempt(lambda: layers[1].rebalance())
        else:
            ended = _attempt(lambda: layer.rebalance(load))
        if real is not None and rank == bad_rank:
            if fault == "reload":
                del layer._staged_experts  # the instance attribute: the method shows again
            else:
                setattr(owner, step, real)
        after = layer.placement
        holds = slots_hold_their_experts(layer, spec)
        next_ok = forward_matches(layer, spec, seed=3)
        layer.rebalance()  # a clean rebalance after the failed one goes through on every rank
        moved = layer.placement != after and slots_hold_their_experts(layer, spec)
        dist.barrier()
        fingerprint = after.fingerprint()
        return Outcome(rank, *ended, fingerprint, after == initial, holds, next_ok, moved, in_place)
    finally:
        for built in layers:
            built.close()


def failing_automatic_rebalance(spec: CaseSpec, redundant: int, bad_rank: int) -> Outcome:
    """``eplb_interval=2``: the second forward rebalances by itself, and ``bad_rank``'s backend
    reload fails there; every rank's forward raises, the next forwards are correct."""
    rank = dist.get_rank()
    layer = build_layer(spec, redundant, eplb_interval=2)
    try:
        initial = layer.placement
        forward_matches(layer, spec, seed=1)
        if rank == bad_rank:
            layer._staged_experts = _failing("reload")
        ended = _attempt(lambda: forward_matches(layer, spec, seed=2))
        if rank == bad_rank:
            del layer._staged_experts
        after = layer.placement
        holds = slots_hold_their_experts(layer, spec)
        next_ok = forward_matches(layer, spec, seed=3)
        forward_matches(layer, spec, seed=4)  # the fourth forward rebalances, cleanly
        moved = layer.placement != after and slots_hold_their_experts(layer, spec)
        dist.barrier()
        fingerprint = after.fingerprint()
        return Outcome(rank, *ended, fingerprint, after == initial, holds, next_ok, moved, False)
    finally:
        layer.close()


def diverged_placement(spec: CaseSpec, redundant: int, bad_rank: int) -> tuple[str, str, bool]:
    """``bad_rank`` alone switches to another placement, outside any placement change (as a
    lost update would leave it); the next forward must fail on every rank, naming it, instead of
    computing with experts the others do not expect there. Returns (error type, message, whether
    a forward after every rank is back on one placement is correct)."""
    rank = dist.get_rank()
    layer = build_layer(spec, redundant)
    try:
        initial = layer.placement
        if rank == bad_rank:
            load = torch.arange(spec.num_experts, dtype=torch.float64) ** 2
            other = rebalanced_placement(load, initial)
            w13, w2 = make_weights(spec)
            index = torch.tensor(other.experts_on_rank(rank))
            slot13, slot2 = w13.index_select(0, index), w2.index_select(0, index)
            layer.eplb.install(other, slot13, slot2, *layer.eplb.device_map.tables(other))
            layer._serve_placement(layer._staged_experts(slot13, slot2), other)
        ended = _attempt(lambda: forward_matches(layer, spec, seed=1))
        if rank == bad_rank:  # back to the placement every other rank holds
            w13, w2 = make_weights(spec)
            index = torch.tensor(initial.experts_on_rank(rank))
            slot13, slot2 = w13.index_select(0, index), w2.index_select(0, index)
            layer.eplb.install(initial, slot13, slot2, *layer.eplb.device_map.tables(initial))
            layer._serve_placement(layer._staged_experts(slot13, slot2), initial)
        next_ok = forward_matches(layer, spec, seed=2)
        dist.barrier()
        return ended[0], ended[1], next_ok
    finally:
        layer.close()


def _die(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(layer: EPMoE, point: str) -> None:
    """Make this rank die at ``point`` (of ``KILL_POINTS``) of its next placement change."""
    if point == "open":
        layer.dispatcher.open_placement_change = _die
    elif point == "vote":
        layer.dispatcher.comm.vote = _die
    elif point == "after_vote":
        PlacementChange.commit = _die
    else:
        setattr(PlacementChange, point, _die)


def killed_rebalance(spec: CaseSpec, redundant: int, victim: int, point: str) -> dict:
    """A forward, then a rebalance in which ``victim`` SIGKILLs itself at ``point`` (this
    process, which its pool then loses); each survivor returns how its rebalance ended and how
    long it took, the placement and slot weights it holds afterwards and how its next forward
    ended."""
    layer = build_layer(spec, redundant)
    try:
        forward_matches(layer, spec, seed=1)  # the group is up and counted a skewed load
        initial = layer.placement
        if dist.get_rank() == victim:
            _arm(layer, point)
        error_type, message, seconds = _attempt(layer.rebalance)
        next_error_type, next_message, next_seconds = _attempt(
            lambda: forward_matches(layer, spec, seed=2)
        )
        return {
            "error_type": error_type,
            "message": message,
            "seconds": seconds,
            "fingerprint": layer.placement.fingerprint(),
            "initial": layer.placement == initial,
            "slots_hold_their_experts": slots_hold_their_experts(layer, spec),
            "next_error_type": next_error_type,
            "next_message": next_message,
            "next_seconds": next_seconds,
        }
    finally:
        layer.close()
