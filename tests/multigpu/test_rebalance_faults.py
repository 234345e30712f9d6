"""A placement change is a transaction (eplb/transaction.py), fault-injected at each step on CPU
ranks (gloo, W = 4): an exception in each local step, a peer that skips the call, rebalances
another layer or passes another load, the automatic rebalance (``eplb_interval``) failing, and a
peer SIGKILLed as it enters each collective. Each case asserts: no healthy rank dies; one
placement on every live rank; each slot's weights bitwise the expert its placement names; every
survivor raises naming the culprit within 5 s; the next forward is correct against
``reference_moe`` (after a kill: it is refused at once, naming the dead rank — the group has
lost a member)."""

from __future__ import annotations

import pytest

from tests.multigpu import rebalance_faults
from tests.multigpu.pool import RankPool
from tests.multigpu.rank_inputs import CaseSpec

WORLD = 4
BAD = 2
WITHIN_S = 5.0
REDUNDANT = 4


def _spec(**changes) -> CaseSpec:
    base = dict(experts="grouped_mm", num_experts=16 - REDUNDANT, hidden=64, cap=32)
    return CaseSpec(**{**base, **changes})


def _check_common(outcomes) -> None:
    """One placement on every rank (the initial one), each slot bitwise its expert, the next
    forward correct, and a clean rebalance afterwards moving experts on every rank."""
    assert len({o.fingerprint for o in outcomes}) == 1, outcomes
    for outcome in outcomes:
        assert outcome.initial, outcome
        assert outcome.slots_hold_their_experts, outcome
        assert outcome.next_forward_ok, outcome
        assert outcome.clean_rebalance_moved, outcome
        assert outcome.seconds < WITHIN_S, outcome


@pytest.mark.parametrize("step", rebalance_faults.FAILING_STEPS)
def test_an_exception_in_each_step_fails_every_rank_and_keeps_the_old_placement(
    pool_factory, step: str
) -> None:
    spec = _spec(layout="expanded" if step in ("pack", "stage") else "standard")
    outcomes = pool_factory(WORLD).run_ok(
        rebalance_faults.faulty_rebalance, spec, REDUNDANT, BAD, step, timeout_s=120
    )
    _check_common(outcomes)
    assert all(o.in_place == (step in rebalance_faults.IN_PLACE) for o in outcomes), outcomes
    for outcome in outcomes:
        if outcome.rank == BAD:
            assert outcome.error_type == "RuntimeError", outcome
            assert rebalance_faults.INJECTED in outcome.message, outcome
        else:
            assert outcome.error_type == "RemoteRankError", outcome
            assert f"rank {BAD} failed: during rebalance: RuntimeError" in outcome.message
            assert rebalance_faults.INJECTED in outcome.message, outcome


@pytest.mark.parametrize("fault", rebalance_faults.ELSEWHERE)
def test_a_peer_elsewhere_is_named_not_waited_for(pool_factory, fault: str) -> None:
    spec = _spec(mode="capacity") if fault == "skip" else _spec()
    outcomes = pool_factory(WORLD).run_ok(
        rebalance_faults.faulty_rebalance, spec, REDUNDANT, BAD, fault, timeout_s=120
    )
    _check_common(outcomes)
    for outcome in outcomes:
        if fault == "other_load":  # every rank lists each rank's placement: BAD's differs
            assert outcome.error_type == "EPInputError", outcome
            assert outcome.message.startswith("load: expected the same load on every rank")
            prints = dict(
                part.split(" = ") for part in outcome.message.split(", given ")[1].split(", ")
            )
            assert len({v for r, v in prints.items() if r != f"rank {BAD}"}) == 1, prints
            assert prints[f"rank {BAD}"] != prints["rank 0"], prints
            continue
        assert outcome.error_type == "ForwardMismatchError", outcome
        if outcome.rank != BAD:
            named = "is in dispatch" if fault == "skip" else "runs layer 1"
            assert f"rank {BAD} {named}" in outcome.message, outcome
        elif fault == "skip":
            assert "rank 0 is in a placement change" in outcome.message, outcome
        else:
            assert "rank 0 runs layer 0" in outcome.message, outcome


def test_a_rank_on_another_placement_is_named_at_the_next_forward(pool_factory) -> None:
    results = pool_factory(WORLD).run_ok(
        rebalance_faults.diverged_placement, _spec(), REDUNDANT, BAD, timeout_s=120
    )
    for rank, (error_type, message, next_ok) in enumerate(results):
        assert error_type == "ForwardMismatchError", (rank, message)
        named = "rank 0 runs layer 0" if rank == BAD else f"rank {BAD} runs layer 0"
        assert named in message and "settings and placement" in message, (rank, message)
        assert next_ok, rank


def test_the_automatic_rebalance_failing_fails_the_forward_on_every_rank(pool_factory) -> None:
    outcomes = pool_factory(WORLD).run_ok(
        rebalance_faults.failing_automatic_rebalance, _spec(), REDUNDANT, BAD, timeout_s=120
    )
    _check_common(outcomes)
    for outcome in outcomes:
        expected = "RuntimeError" if outcome.rank == BAD else "RemoteRankError"
        assert outcome.error_type == expected, outcome
        assert rebalance_faults.INJECTED in outcome.message, outcome


@pytest.mark.parametrize("point", rebalance_faults.KILL_POINTS)
def test_a_peer_killed_inside_a_rebalance_is_named_and_no_survivor_diverges(point: str) -> None:
    """A group of its own (the kill ends it), of rank processes forked from the pools' server."""
    results, codes = RankPool(WORLD).run_with_a_death(
        rebalance_faults.killed_rebalance, _spec(), REDUNDANT, BAD, point, dying=BAD
    )
    reactions = [r for rank, r in enumerate(results) if rank != BAD]
    assert all(isinstance(r, dict) for r in reactions), (results, codes)
    for rank, code in enumerate(codes):  # no healthy rank dies
        assert code == (-9 if rank == BAD else 0), (rank, code, results[rank])
    assert len({r["fingerprint"] for r in reactions}) == 1, reactions
    for reaction in reactions:
        assert reaction["slots_hold_their_experts"], reaction
        assert reaction["seconds"] < WITHIN_S, reaction
        if point == "after_vote":  # it voted yes: every survivor commits the new placement
            assert reaction["error_type"] == "none" and not reaction["initial"], reaction
            assert reaction["next_error_type"] == "RemoteRankError", reaction
            assert f"rank {BAD} failed" in reaction["next_message"], reaction
        else:
            assert reaction["initial"], reaction
            assert reaction["error_type"] == "RemoteRankError", reaction
            assert f"rank {BAD} failed" in reaction["message"], reaction
            assert reaction["next_error_type"] == "GroupUnusableError", reaction
            assert f"rank {BAD}" in reaction["next_message"], reaction
        assert reaction["next_seconds"] < WITHIN_S, reaction
