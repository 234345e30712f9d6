"""Driver-side checks shared by every dispatcher's multi-rank tests (the torch suite, and the
DeepEP and symmetric-memory adapters against their imitations): one body per property."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.multigpu import fault_cases, layer_cases, rank_inputs
from tests.multigpu.layer_cases import CaseResult
from tests.multigpu.rank_inputs import CaseSpec

RunCase = Callable[[CaseSpec], list[CaseResult]]  # runs a layer case on every rank

BAD_INPUTS = [
    ("id_out_of_range", "exact"),
    ("id_out_of_range", "capacity"),
    ("wrong_hidden", "exact"),
    ("wrong_hidden", "capacity"),
    ("too_many_tokens", "capacity"),  # exact mode chunks T > cap instead
]
BAD_INPUT_ARGUMENT = {"id_out_of_range": "topk_ids", "wrong_hidden": "x", "too_many_tokens": "x"}


def assert_all_pass(results: list[CaseResult]) -> None:
    bad = [f"rank {r.rank}: {r.comparison.describe()}" for r in results if not r.comparison.passed]
    assert not bad, "\n".join(bad)


def run_layer_cases(pool, spec: CaseSpec) -> list[CaseResult]:
    """A layer case on every rank: the named dispatcher must be the one that ran, and every rank
    must match ``reference_moe``."""
    results = pool.run_ok(layer_cases.run_layer_case, spec)
    assert {r.dispatcher for r in results} == {spec.dispatcher}, "another dispatcher ran"
    assert_all_pass(results)
    return results


def assert_poison_matches_clean(run: RunCase, spec: CaseSpec) -> None:
    """NaN in padding rows, -1-slot weights and preallocated outputs must not leak: the poisoned
    run is finite and bitwise equal to the clean one."""
    clean = run(spec)
    poisoned = run(rank_inputs.with_spec(spec, poison=True))
    assert_all_pass(poisoned)
    for c, p in zip(clean, poisoned, strict=True):
        assert torch.isfinite(p.output).all()
        assert torch.equal(c.output, p.output), f"rank {c.rank}: poison changed the output"


def assert_bad_input_fails_every_rank(
    pool, run: RunCase, spec: CaseSpec, fault: str, mode: str
) -> None:
    """The last rank passes bad input: it raises ValueError naming the argument; every other
    rank raises an error naming it, within 30 s; the group stays usable (nobody hangs)."""
    world_size = pool.world_size
    bad_rank = world_size - 1
    spec = rank_inputs.with_spec(spec, mode=mode, tokens=(5,) * world_size)
    results = pool.run_ok(fault_cases.timed_bad_input, spec, bad_rank, fault, timeout_s=60)
    argument = BAD_INPUT_ARGUMENT[fault]
    # capacity mode on CUDA checks id values on the device only: the bad rank's check() raises,
    # peers are not told (docs/architecture.md, "Failures"); shape errors still reach them
    peers_told = not (mode == "capacity" and pool.backend == "nccl" and fault == "id_out_of_range")
    for rank, (type_name, message, seconds) in enumerate(results):
        assert seconds < 30, f"rank {rank} took {seconds:.1f} s"
        if rank == bad_rank:
            assert type_name == "EPInputError" and message.startswith(f"{argument}:"), message
        elif peers_told:
            assert type_name == "RemoteRankError", (type_name, message)
            assert f"rank {bad_rank} failed" in message, message
            if pool.backend == "gloo" or mode == "exact":  # the message travels with the status
                assert f"{argument}: expected" in message, message
        else:
            assert type_name == "none", (type_name, message)
    assert_all_pass(run(spec))
