"""The multi-rank suite: every (dispatcher × experts × layout × activation × mode) from the
registries, on real ranks (gloo on CPU, NCCL with one GPU per rank), each rank checked per token
against ``reference_moe`` with the derived tolerance (ep_runtime/tolerance.py).

Backends defined outside the package join the registries through ``EP_TEST_BACKEND_MODULES``
(comma-separated modules whose ``register()`` runs here and in every rank process), e.g.
``EP_TEST_BACKEND_MODULES=tests.support.memory_transport EP_TEST_WORLD_SIZES=1`` for the in-memory
transport (a world of one only)."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable

import pytest
import torch

from ep_runtime.dispatch import DISPATCHERS
from ep_runtime.experts import EXPERTS
from ep_runtime.experts.triton import interpreting
from ep_runtime.types import Activation, DispatchMode, TopkLayout
from tests.multigpu import checks, dispatch_cases, layer_cases, rank_inputs
from tests.multigpu.expectations import INTERPRETED_MAX_WORLD_SIZE, expected_refusal
from tests.multigpu.pool import RankFailure, import_test_backends
from tests.multigpu.rank_inputs import CaseSpec

import_test_backends()

# EP_TEST_WORLD_SIZES=1,2,4,8 on a machine with 8 GPUs runs NCCL across all of them
LOCAL = "local"  # the world-of-one transport
WORLD_SIZES = tuple(int(w) for w in os.environ.get("EP_TEST_WORLD_SIZES", "1,2,4").split(","))


def backend_matrix(dispatchers: Iterable[str] | None = None):
    """Every combination with each of ``dispatchers`` (default: every registered one) and every
    backend that serves unquantized weights (fp8-only ones: test_fp8_layer.py)."""
    unquantized = [
        name for name in EXPERTS.names() if None in EXPERTS[name].capabilities.quantizations
    ]
    for dispatcher, experts, layout, activation, mode in itertools.product(
        DISPATCHERS.names() if dispatchers is None else dispatchers,
        unquantized,
        TopkLayout,
        Activation,
        DispatchMode,
    ):
        yield CaseSpec(
            dispatcher=dispatcher,
            experts=experts,
            layout=layout.value,
            activation=activation.value,
            mode=mode.value,
        )


def case_id(spec: CaseSpec) -> str:
    return f"{spec.dispatcher}-{spec.experts}-{spec.layout}-{spec.activation}-{spec.mode}"


def run_checked(pool, spec: CaseSpec, faults: tuple[str, ...] = ()):
    """Run a layer case on every rank; skip (with the reason) only for a refusal this machine
    predicts, with the message it predicts (tests/multigpu/expectations.py)."""
    results = pool.run(layer_cases.run_layer_case, spec, faults)
    failures = [r for r in results if isinstance(r, RankFailure)]
    if failures:
        refused = [f for f in failures if f.type_name == "BackendUnavailableError"]
        if len(refused) == len(results):
            device_type = "cuda" if pool.backend == "nccl" else "cpu"
            patterns = [
                expected_refusal(name, device_type, spec.dtype, pool.world_size)
                for name in (spec.dispatcher, spec.experts)
            ]
            message = refused[0].message
            if any(p and re.search(p, message) for p in patterns):
                pytest.skip(f"expected refusal: {message}")
        raise AssertionError("\n".join(f"{f}\n{f.traceback}" for f in failures))
    return results


def suite_cases():
    """(world size, case) for the layer matrix: every case at every world size, but the
    interpreted Triton experts at world sizes up to ``INTERPRETED_MAX_WORLD_SIZE``."""
    for spec in backend_matrix():
        for world_size in WORLD_SIZES:
            interpreted = spec.experts == "triton" and interpreting()
            if interpreted and world_size > INTERPRETED_MAX_WORLD_SIZE:
                continue
            if spec.dispatcher == LOCAL and world_size > 1:  # refused: test_local_dispatcher.py
                continue
            yield pytest.param(world_size, spec, id=f"{case_id(spec)}-{world_size}")


@pytest.mark.parametrize(("world_size", "spec"), list(suite_cases()))
def test_layer_matches_reference(pool_factory, world_size: int, spec: CaseSpec) -> None:
    check_layer_matches_reference(pool_factory(world_size), spec)


def check_layer_matches_reference(pool, spec: CaseSpec) -> None:
    results = run_checked(pool, spec)
    checks.assert_all_pass(results)
    assert {r.layout for r in results} == {spec.layout}


@pytest.mark.parametrize("experts", ["reference", "grouped_mm"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
def test_fp32(pool_factory, experts: str, layout: str, mode: str) -> None:
    spec = CaseSpec(experts=experts, layout=layout, mode=mode, dtype=torch.float32)
    checks.assert_all_pass(run_checked(pool_factory(2), spec))


@pytest.mark.parametrize("experts", ["reference", "grouped_mm"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("edge", list(rank_inputs.EDGE_CASES))
def test_edge_cases(pool_factory, edge: str, mode: str, layout: str, experts: str) -> None:
    spec = CaseSpec(experts=experts, layout=layout, mode=mode, **rank_inputs.EDGE_CASES[edge])
    checks.assert_all_pass(run_checked(pool_factory(2), spec))


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_idle_rank_may_pass_another_k(pool_factory, layout: str) -> None:
    spec = CaseSpec(experts="grouped_mm", layout=layout, **rank_inputs.IDLE_RANK_OTHER_K)
    checks.assert_all_pass(run_checked(pool_factory(2), spec))


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_exact_mode_chunks_past_the_cap(pool_factory, layout: str) -> None:
    """T > cap in exact mode: rank 0 needs 3 chunks, rank 1 keeps sending empty slices."""
    spec = CaseSpec(experts="grouped_mm", layout=layout, **rank_inputs.CHUNKED_PAST_CAP)
    checks.assert_all_pass(run_checked(pool_factory(2), spec))


@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_world_of_four_edges(pool_factory, mode: str, layout: str) -> None:
    spec = CaseSpec(
        experts="grouped_mm",
        layout=layout,
        mode=mode,
        tokens=(0, 1, 6, 13),
        num_experts=4,
        top_k=2,
    )
    checks.assert_all_pass(run_checked(pool_factory(4), spec))


NEGATIVE_CONTROLS = (
    "zero_output",
    "gate_up_swapped",
    "weights_0x",
    "weights_2x",
    "dropped_slot",
    "ids_off_by_rank",
    "minus_one_is_expert",
)


@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("fault", NEGATIVE_CONTROLS)
def test_negative_controls_fail_the_checker(pool_factory, fault: str, layout: str) -> None:
    """Each injected bug must make the per-token check fail; the clean run must pass."""
    spec = CaseSpec(experts="grouped_mm", layout=layout, tokens=(9, 12))
    pool = pool_factory(2)
    checks.assert_all_pass(run_checked(pool, spec))
    faulty = run_checked(pool, spec, (fault,))
    assert any(not r.comparison.passed for r in faulty), (
        f"checker passed the '{fault}' bug: " + "; ".join(r.comparison.describe() for r in faulty)
    )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_dispatch_is_bitwise(pool_factory, world_size: int, mode: str, layout: str) -> None:
    spec = CaseSpec(layout=layout, mode=mode, top_k=3, tokens=(9, 0, 5, 12)[:world_size])
    counts = pool_factory(world_size).run_ok(dispatch_cases.check_dispatch_bitwise, spec)
    assert sum(counts) > 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_round_trip_is_exact(pool_factory, world_size, dtype, mode, layout) -> None:
    spec = CaseSpec(layout=layout, mode=mode, dtype=dtype, top_k=4, num_experts=8)
    rows = pool_factory(world_size).run_ok(dispatch_cases.check_round_trip, spec)
    assert sum(rows) > 0


@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("experts", ["reference", "grouped_mm"])
def test_poison_mode_matches_clean_run(pool_factory, mode, layout, experts) -> None:
    pool = pool_factory(2)
    spec = CaseSpec(experts=experts, layout=layout, mode=mode, tokens=(6, 11))
    checks.assert_poison_matches_clean(lambda s: run_checked(pool, s), spec)


def test_two_runs_are_bitwise_equal(pool_factory) -> None:
    spec = CaseSpec(experts="grouped_mm", layout="expanded", tokens=(13, 7))
    pool = pool_factory(2)
    first, second = run_checked(pool, spec), run_checked(pool, spec)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.output, b.output)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("fault", "mode"), checks.BAD_INPUTS)
def test_bad_input_on_one_rank_fails_every_rank(pool_factory, world_size, mode, fault) -> None:
    pool = pool_factory(world_size)
    checks.assert_bad_input_fails_every_rank(
        pool, lambda s: run_checked(pool, s), CaseSpec(experts="grouped_mm"), fault, mode
    )
