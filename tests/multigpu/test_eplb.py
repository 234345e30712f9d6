"""Expert load balancing on real ranks (gloo on CPU, NCCL with a GPU per rank): forward vs
``reference_moe`` before and after a rebalance at W = 2, 3, 4, both layouts and modes, R = 0,
1 and several; the placement agreed by every rank; weights moved exactly where the placement
changed (counted); every rank raising, and staying on the old placement, when one passes a bad
or different load (the faults of every step: test_rebalance_faults.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from ep_runtime import EPMoE, reference_moe
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import (
    CaseSpec,
    build_layer,
    device,
    make_weights,
    skewed_inputs,
    with_spec,
)

REDUNDANT = (0, 1, 4)
WORLD_SIZES = (2, 3, 4)


def num_experts_for(world_size: int, redundant: int) -> int:
    """The smallest E >= 8 with (E + R) a multiple of W."""
    return next(e for e in itertools.count(8) if (e + redundant) % world_size == 0)


def _spec(world_size: int, redundant: int, **changes) -> CaseSpec:
    base = CaseSpec(num_experts=num_experts_for(world_size, redundant), hidden=64, cap=32)
    return with_spec(base, **changes)


def _matches(layer: EPMoE, spec: CaseSpec, seed: int) -> tuple[bool, torch.Tensor]:
    x, ids, weights = skewed_inputs(spec, seed)
    w13, w2 = make_weights(spec)
    ref, scale = reference_moe(x, ids, weights, w13, w2, spec.activation, return_scale=True)
    dev = device()
    out = layer(x.to(dev), ids.to(dev), weights.to(dev))
    layer.check()
    tolerance = tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate))
    comparison = compare_per_token(out, ref, tolerance, scale)
    assert comparison.passed, f"rank {dist.get_rank()}: {comparison.describe()}"
    return comparison.passed, out.cpu()


def _all_done() -> None:
    """Wait for every rank to finish its forwards before any closes its layer: on an
    overloaded machine a peer still completing the last combine can take the close notice for
    a failure once the collective takes longer than ``peers.SETTLE_S`` (seen with a load
    average of 27 on 2 cores; a dispatcher matter, outside what these tests check)."""
    dist.barrier()


def rebalance_case(spec: CaseSpec, redundant: int) -> dict:
    """Forward, count, rebalance, forward. Returns what the driver checks across ranks."""
    rank = dist.get_rank()
    layer = build_layer(spec, redundant)
    try:
        _, before_out = _matches(layer, spec, seed=1)
        load = layer.expert_load()
        _, ids, _ = skewed_inputs(spec, seed=1)  # the hand count: every rank's used ids
        hand = torch.bincount(ids[ids >= 0].long(), minlength=spec.num_experts)
        hand = hand.to(device())
        dist.all_reduce(hand)
        assert torch.equal(layer.placement.fold(load.cpu()), hand.cpu()), (load, hand)
        old = layer.placement
        old13 = layer.eplb.slot_weights[0].clone()
        report = layer.rebalance()
        new = layer.placement
        new13, new2 = layer.eplb.slot_weights
        w13, w2 = make_weights(spec)
        slots = list(new.slots_of_rank(rank))
        for local, slot in enumerate(slots):  # every slot holds its new expert's weights
            expert = new.physical_to_logical[slot]
            assert torch.equal(new13[local].cpu(), w13[expert]), f"slot {slot}"
            assert torch.equal(new2[local].cpu(), w2[expert]), f"slot {slot}"
        rewritten = sum(not torch.equal(old13[local], new13[local]) for local in range(len(slots)))
        _, after_out = _matches(layer, spec, seed=2)
        _all_done()
        return {
            "rank": rank,
            "old": old.physical_to_logical,
            "new": new.physical_to_logical,
            "fingerprint": new.fingerprint(),
            "slots_per_rank": new.slots_per_rank,
            "changed_here": sum(
                old.physical_to_logical[s] != new.physical_to_logical[s] for s in slots
            ),
            "rewritten_here": rewritten,
            "report": report,
            "expert_bytes": (w13[0].numel() + w2[0].numel()) * w13.element_size(),
            "outputs": (before_out, after_out),
        }
    finally:
        layer.close()


def rebalance_cases(specs: list[CaseSpec], redundant: int) -> list[dict]:
    return [rebalance_case(spec, redundant) for spec in specs]


def _check_rebalanced(results: list[dict], spec: CaseSpec, redundant: int, world: int) -> None:
    first = results[0]
    assert len({r["fingerprint"] for r in results}) == 1, "ranks ended on different placements"
    new = first["new"]
    assert len(new) == spec.num_experts + redundant
    assert set(new) == set(range(spec.num_experts)), "an expert lost its last replica"
    assert first["slots_per_rank"] * world == len(new)
    changed = sum(a != b for a, b in zip(first["old"], new, strict=True))
    report = first["report"]
    assert report.changed_slots == changed == sum(r["changed_here"] for r in results)
    # weights were rewritten exactly in the slots whose expert changed
    assert sum(r["rewritten_here"] for r in results) == changed
    assert report.local_copies + report.remote_slots == changed
    assert report.bytes_moved == report.remote_slots * first["expert_bytes"]


@pytest.mark.parametrize("redundant", REDUNDANT)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rebalance_matches_reference_and_moves_only_changed_slots(
    pool_factory, world_size: int, redundant: int
) -> None:
    pool = pool_factory(world_size)
    specs = [
        _spec(world_size, redundant, layout=layout, mode=mode)
        for layout, mode in itertools.product(("standard", "expanded"), ("exact", "capacity"))
    ]
    per_rank = pool.run_ok(rebalance_cases, specs, redundant, timeout_s=300)
    for index, spec in enumerate(specs):
        _check_rebalanced([results[index] for results in per_rank], spec, redundant, world_size)
    # the skewed load moves experts between ranks: the all-to-all of weights ran
    assert any(results["report"].remote_slots > 0 for results in per_rank[0])


def test_two_identical_runs_are_bitwise_equal(pool_factory) -> None:
    pool = pool_factory(2)
    spec = _spec(2, 4, experts="grouped_mm", layout="expanded")
    first = pool.run_ok(rebalance_case, spec, 4)
    second = pool.run_ok(rebalance_case, spec, 4)
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["outputs"], b["outputs"], strict=True))
        assert a["fingerprint"] == b["fingerprint"]


def failing_rebalance(spec: CaseSpec, redundant: int, bad_rank: int, fault: str) -> dict:
    """``bad_rank`` fails its rebalance (``fault``); every rank reports how its call ended,
    whether its placement and weights are the old ones, and whether the next forward and a
    clean rebalance after it still work."""
    rank = dist.get_rank()
    layer = build_layer(spec, redundant)
    try:
        _matches(layer, spec, seed=1)
        before = layer.placement
        weights_before = [w.clone() for w in layer.eplb.slot_weights]
        load = None
        if rank == bad_rank and fault == "bad_load":
            load = torch.ones(3)
        if fault == "different_loads":
            load = torch.arange(spec.num_experts, dtype=torch.float64) ** (rank + 1)
        try:
            layer.rebalance(load)
            ended = ("none", "")
        except Exception as error:  # every kind of ending is reported to the driver
            ended = (type(error).__name__, str(error))
        unchanged = layer.placement == before and all(
            torch.equal(a, b) for a, b in zip(weights_before, layer.eplb.slot_weights, strict=True)
        )
        next_ok, _ = _matches(layer, spec, seed=2)
        layer.rebalance()  # a clean rebalance after the failed one goes through on every rank
        _all_done()
        return {"ended": ended, "unchanged": unchanged, "next_ok": next_ok}
    finally:
        layer.close()


@pytest.mark.parametrize("world_size", (2, 3))
def test_one_rank_failing_its_rebalance_fails_every_rank(pool_factory, world_size: int) -> None:
    """A bad ``load`` on one rank (found before the change's first collective, agreed in its
    third); the faults of every step at W = 4 are in test_rebalance_faults.py."""
    pool = pool_factory(world_size)
    bad_rank = world_size - 1
    spec = _spec(world_size, 4)
    results = pool.run_ok(failing_rebalance, spec, 4, bad_rank, "bad_load", timeout_s=120)
    for rank, result in enumerate(results):
        type_name, message = result["ended"]
        if rank == bad_rank:
            assert type_name == "EPInputError" and message.startswith("load: expected"), message
        else:
            assert type_name == "RemoteRankError", (type_name, message)
            assert f"rank {bad_rank} failed: during rebalance:" in message, message
        assert result["unchanged"], f"rank {rank} left the old placement or weights"
        assert result["next_ok"]


def test_ranks_with_different_loads_all_raise(pool_factory) -> None:
    pool = pool_factory(2)
    spec = _spec(2, 4)
    results = pool.run_ok(failing_rebalance, spec, 4, -1, "different_loads", timeout_s=120)
    for result in results:
        type_name, message = result["ended"]
        assert type_name == "EPInputError", (type_name, message)
        assert message.startswith("load: expected the same load on every rank"), message
        assert result["unchanged"] and result["next_ok"]
