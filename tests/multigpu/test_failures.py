"""The failure protocol (issue: no silent wrong output): each way one rank can misbehave ends as
an exception on every rank, naming the rank and the cause, within seconds, with no rank returning
output, hanging or dying by a signal; where the group can go on, the next forward is correct.

Gloo ranks on CPU with a 60 s group timeout, so "within 15 s" cannot be the timeout firing."""

from __future__ import annotations

import pytest

from ep_runtime.dispatch.setup import DEVICE_CHECKS_ENV
from tests.multigpu import dying_rank, fault_cases
from tests.multigpu.pool import RankPool
from tests.multigpu.rank_inputs import CaseSpec
from tests.multigpu.rank_scripts import run_rank_scripts

GROUP_TIMEOUT_S = 60.0
WITHIN_S = 15.0
SETUPS = [
    (world, mode, layout)
    for world in (2, 3)
    for mode in ("exact", "capacity")
    for layout in ("standard", "expanded")
]
_POOLS: dict[tuple[int, bool], RankPool] = {}


def pool_of(world_size: int, checks_on_device: bool = False) -> RankPool:
    """A pool per world size; ``checks_on_device``: capacity mode checks headers on the device
    (as on CUDA) on these CPU ranks too."""
    key = (world_size, checks_on_device)
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        env = {DEVICE_CHECKS_ENV: "1"} if checks_on_device else {}
        pool = RankPool(world_size, group_timeout_s=GROUP_TIMEOUT_S, env=env)
        _POOLS[key] = pool
    return pool


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    for pool in _POOLS.values():
        pool.close()


def spec_for(world: int, mode: str, layout: str) -> CaseSpec:
    return CaseSpec(
        experts="grouped_mm", mode=mode, layout=layout, num_experts=6, tokens=(6, 9, 4)[:world]
    )


def assert_reactions(reactions, bad_rank: int, own_error: str, cause: str, peers_say: str) -> None:
    """The bad rank raised ``own_error``; every other rank a RemoteRankError naming it with
    ``peers_say`` in the message; all within the bound."""
    for reaction in reactions:
        assert reaction.seconds < WITHIN_S, reaction
        if reaction.rank == bad_rank:
            assert reaction.error_type == own_error and cause in reaction.message, reaction
        else:
            assert reaction.error_type == "RemoteRankError", reaction
            assert f"rank {bad_rank} failed" in reaction.message, reaction
            assert peers_say in reaction.message, reaction


@pytest.mark.parametrize(("world", "mode", "layout"), SETUPS)
def test_experts_failing_mid_forward_fails_every_rank(world, mode, layout) -> None:
    bad = world - 1
    pool = pool_of(world)
    reactions = pool.run_ok(
        fault_cases.experts_fail_mid_forward, spec_for(world, mode, layout), bad
    )
    assert_reactions(reactions, bad, "RuntimeError", fault_cases.INJECTED, fault_cases.INJECTED)
    assert all(r.next_forward_ok for r in reactions), reactions


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("setting", list(fault_cases.MISMATCHED_SETTINGS))
def test_layers_built_differently_fail_at_build(world, setting) -> None:
    bad = world - 1
    spec = spec_for(world, "exact", "expanded")
    reactions = pool_of(world).run_ok(fault_cases.built_with_other_setting, spec, bad, setting)
    argument = {"hidden": "hidden_size", "cap": "max_tokens_per_rank"}.get(setting, setting)
    for reaction in reactions:
        assert reaction.error_type == "EPInputError", reaction
        assert reaction.message.startswith(f"{argument}: expected the same value on every rank")
        assert f"rank {bad} = " in reaction.message, reaction
        assert reaction.seconds < WITHIN_S and reaction.next_forward_ok, reaction


@pytest.mark.parametrize("how", ["skip", "app_exception"])
@pytest.mark.parametrize(("world", "mode", "layout"), SETUPS)
def test_a_skipped_layer_is_detected(world, mode, layout, how) -> None:
    bad = world - 1
    pool = pool_of(world)
    reactions = pool.run_ok(fault_cases.skips_a_layer, spec_for(world, mode, layout), bad, how)
    for reaction in reactions:
        assert reaction.error_type == "ForwardMismatchError", reaction
        expected = "rank 0 runs layer 0" if reaction.rank == bad else f"rank {bad} runs layer 1"
        assert expected in reaction.message, reaction
        assert "skipped or repeated a forward" in reaction.message, reaction
        assert reaction.seconds < WITHIN_S and reaction.next_forward_ok, reaction


@pytest.mark.parametrize(("world", "mode", "layout"), SETUPS)
def test_a_forward_left_over_fails_instead_of_waiting(world, mode, layout) -> None:
    bad = world - 1
    pool = pool_of(world)
    try:
        per_rank = pool.run_ok(
            fault_cases.skips_a_forward_of_one_layer, spec_for(world, mode, layout), bad
        )
    finally:
        pool.close()  # the others left their last collective: this group is out of step
    for rank, reactions in enumerate(per_rank):
        paired, left_over = reactions[:2], reactions[2:]
        assert all(r.error_type == "none" and r.next_forward_ok for r in paired), reactions
        if rank == bad:
            assert not left_over
            continue
        (last,) = left_over
        assert last.error_type == "RemoteRankError", last
        assert f"rank {bad} failed: closed layer" in last.message and last.seconds < WITHIN_S


@pytest.mark.parametrize(("world", "mode"), [(2, "exact"), (3, "capacity")])
def test_close_then_forward_fails_every_rank(world, mode) -> None:
    bad = world - 1
    pool = pool_of(world)
    try:
        reactions = pool.run_ok(
            fault_cases.closes_then_forwards, spec_for(world, mode, "standard"), bad
        )
    finally:
        pool.close()  # the others left a collective: this group is out of step
    for reaction in reactions:
        assert reaction.seconds < WITHIN_S, reaction
        if reaction.rank == bad:
            assert reaction.error_type == "ClosedError", reaction
            assert f"rank {bad} of {world}" in reaction.message, reaction
        else:
            assert reaction.error_type == "RemoteRankError", reaction
            assert f"rank {bad} failed: closed layer" in reaction.message, reaction


def run_dying_group(world: int, victim: int, scenario: str, mode: str, layout: str):
    """(survivors' reactions, every exit code, every rank's stderr or result): an uncaught
    exception in rank scripts, as a user's (it must go through ``sys.excepthook``); a SIGKILL in
    a pool of its own (the same rank code, in processes forked from the pools' server)."""
    if scenario.startswith("kill"):
        results, codes = RankPool(world).run_with_a_death(
            dying_rank.dying_forward, victim, scenario, mode, layout, dying=victim
        )
        reactions = [result for rank, result in enumerate(results) if rank != victim]
        assert all(isinstance(reaction, dict) for reaction in reactions), (results, codes)
        return reactions, codes, [str(result) for result in results]
    args = {"victim": victim, "scenario": scenario, "mode": mode, "layout": layout}
    return run_rank_scripts("tests.multigpu.dying_rank", world, args)


# every scenario in both set-ups
DYING = [
    (*setup, scenario)
    for setup in ((2, "exact", "standard"), (3, "capacity", "expanded"))
    for scenario in ("raise_before", "raise_inside", "kill_before", "kill_inside")
]


@pytest.mark.parametrize(("world", "mode", "layout", "scenario"), DYING)
def test_a_dying_rank_is_named(world, mode, layout, scenario) -> None:
    victim = world - 1
    reactions, exit_codes, errors = run_dying_group(world, victim, scenario, mode, layout)
    assert len(reactions) == world - 1, (reactions, exit_codes, errors)
    for rank, code in enumerate(exit_codes):  # no process ends by a signal it did not get
        if rank == victim and scenario.startswith("kill"):
            assert code == -9, (code, errors[rank])
        elif rank == victim:  # its own exception ended it
            assert code == 1, (code, errors[rank])
            assert "the application crashed" in errors[rank], errors[rank]
        else:
            assert code == 0, (rank, code, errors[rank])
    for reaction in reactions:
        assert reaction["error_type"] == "RemoteRankError", reaction
        assert f"rank {victim} failed" in reaction["message"], reaction
        if scenario.startswith("raise"):  # its own error reaches the others
            assert "crashed" in reaction["message"], reaction
        assert reaction["seconds"] < WITHIN_S, reaction


# every fault at both world sizes in both layouts
DEVICE_FAULTS = [
    (world, layout, fault)
    for world in (2, 3)
    for layout in ("standard", "expanded")
    for fault in ("experts", "input", "layer")
]


@pytest.mark.parametrize(("world", "layout", "fault"), DEVICE_FAULTS)
def test_checks_on_the_device_poison_the_forward_and_check_names_the_rank(world, layout, fault):
    """Capacity mode on CUDA reads nothing on the host: a failed forward's output is NaN on every
    healthy rank, and ``check()`` raises naming the rank; the failing rank raises its own error
    at once. Run here on CPU ranks with the device-side checks forced on."""
    bad = world - 1
    spec = spec_for(world, "capacity", layout)
    pool = pool_of(world, checks_on_device=True)
    results = pool.run_ok(fault_cases.fails_with_checks_on_device, spec, bad, fault)
    status = {"experts": "INTERNAL_ERROR", "input": "INPUT_ERROR", "layer": "MISMATCH"}[fault]
    for result in results:
        assert result.next_forward_ok, result
        if result.rank == bad and fault != "layer":
            assert result.forward_error in ("RuntimeError", "EPInputError"), result
            assert result.check_error == "none", result
            continue
        assert result.forward_error == "none" and result.output_all_nan, result
        assert result.check_error == "RemoteRankError", result
        named = 0 if result.rank == bad else bad  # a skipped layer: each names the other side
        assert f"rank {named} failed: {status}" in result.check_message, result
