"""The real DeepEP V2 (``deep_ep.ElasticBuffer``) behind ``dispatcher="deepep_v2"``.

The rank-side bodies are the ones the CPU tests run against the imitation
(tests/dispatch/test_deepep_adapter.py): the layer against ``reference_moe`` per token, dispatch
arriving
bit for bit in any order, the exact round trip, bad input on one rank. Everything here skips,
with the reason, unless deep_ep V2 and NCCL >= 2.30.4 (the same libnccl as torch) are usable and
the pool's ranks run NCCL on one GPU each. DeepEP JIT-compiles on first use: the first cases are
slow, hence the long per-case timeout.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ep_runtime.dispatch.deepep_v2 import deep_ep_problems
from ep_runtime.dispatch.nccl_probe import probe_library
from tests.multigpu import (
    checks,
    deepep_cases,
    dispatch_cases,
    fault_cases,
    fp8_cases,
    layer_cases,
    rank_inputs,
)
from tests.multigpu.rank_inputs import CaseSpec

CASE_TIMEOUT_S = 600.0
MULTI_RANK_SIZES = (2, 4, 8)


def real_library_problem() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (DeepEP V2 runs on NVIDIA GPUs)"
    return "; ".join(deep_ep_problems()) or None


pytestmark = pytest.mark.skipif(
    real_library_problem() is not None,
    reason=f"real DeepEP V2 not usable here: {real_library_problem()}",
)


@pytest.fixture
def nccl_pool(pool_factory):
    def get(world_size: int):
        available = torch.cuda.device_count()
        if available < world_size:
            pytest.skip(f"{world_size} ranks need {world_size} GPUs, found {available}")
        pool = pool_factory(world_size)
        if pool.backend != "nccl":
            pytest.skip(f"DeepEP needs NCCL ranks, this pool runs {pool.backend}")
        return pool

    return get


def run_real(pool, spec: CaseSpec):
    results = pool.run_ok(layer_cases.run_layer_case, spec, timeout_s=CASE_TIMEOUT_S)
    assert {r.dispatcher for r in results} == {"deepep_v2"}
    bad = [f"rank {r.rank}: {r.comparison.describe()}" for r in results if not r.comparison.passed]
    assert not bad, "\n".join(bad)
    return results


def test_nccl_is_new_enough_and_single():
    library = probe_library()
    assert library.meets_deepep_minimum and library.has_query_properties, library.describe()
    assert len(library.paths) == 1, library.describe()


@pytest.mark.parametrize("world_size", (1, *MULTI_RANK_SIZES))
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("experts", ["reference", "grouped_mm"])
def test_layer_matches_reference(nccl_pool, world_size, mode, layout, experts):
    spec = CaseSpec(dispatcher="deepep_v2", experts=experts, layout=layout, mode=mode)
    run_real(nccl_pool(world_size), spec)


@pytest.mark.parametrize("world_size", (1, *MULTI_RANK_SIZES))
def test_auto_prefers_deepep_across_ranks(nccl_pool, world_size):
    """Across ranks ``"auto"`` takes DeepEP; a world of one takes ``local`` (nothing moves)."""
    spec = CaseSpec(dispatcher="auto", experts="grouped_mm", layout="expanded")
    results = nccl_pool(world_size).run_ok(
        layer_cases.run_layer_case, spec, timeout_s=CASE_TIMEOUT_S
    )
    assert {r.dispatcher for r in results} == {"deepep_v2" if world_size > 1 else "local"}


@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize(
    "changes",
    [dict(tokens=(0, 9)), dict(tokens=(1, 1)), dict(routing="one_expert"), dict(top_k=4, k=2)],
    ids=["no_tokens_on_rank0", "one_token", "all_to_one_expert", "k_below_top_k"],
)
def test_edge_cases(nccl_pool, changes, layout, mode):
    spec = CaseSpec(dispatcher="deepep_v2", experts="grouped_mm", layout=layout, mode=mode)
    run_real(nccl_pool(2), rank_inputs.with_spec(spec, **changes))


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_exact_mode_chunks_past_the_cap(nccl_pool, layout):
    spec = CaseSpec(dispatcher="deepep_v2", layout=layout, cap=4, tokens=(11, 2))
    run_real(nccl_pool(2), spec)


@pytest.mark.parametrize("quantization", [None, "fp8_block"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("world_size", (1, *MULTI_RANK_SIZES))
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_dispatch_is_bitwise(nccl_pool, world_size, mode, layout, quantization):
    """Rows arrive bit for bit; with fp8 weights DeepEP moves the ``(e4m3, scales)`` pair and
    they arrive as the sender's q(x)."""
    spec = CaseSpec(
        dispatcher="deepep_v2",
        layout=layout,
        mode=mode,
        intermediate=128,  # fp8 blocks tile I (dispatch does not depend on it)
        quantization=quantization,
    )
    pool = nccl_pool(world_size)
    counts = pool.run_ok(
        deepep_cases.check_dispatch_bitwise_any_order, spec, timeout_s=CASE_TIMEOUT_S
    )
    assert sum(counts) > 0


@pytest.mark.parametrize("world_size", (1, *MULTI_RANK_SIZES))
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("experts", ["reference", "triton", "scaled_mm", "deepgemm"])
def test_fp8_layer_matches_the_oracle(nccl_pool, world_size, mode, layout, experts):
    """The fp8 layer over DeepEP's fp8 dispatch against the fp64 oracle of the contract (of its
    declared variant for ``deepgemm``, what ``"auto"`` takes for prefill-sized fp8 layers where
    DeepGEMM is installed; ``scaled_mm`` and ``deepgemm`` on Hopper only)."""
    hopper_only = ("scaled_mm", "deepgemm")
    if experts in hopper_only and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{experts} runs on SM90 only (its fp32 1x128 / 128x128 fp8 scaling)")
    if experts == "deepgemm" and importlib.util.find_spec("deep_gemm") is None:
        pytest.skip("deep_gemm is not installed (docs/deepgemm.md)")
    shapes = {**fp8_cases.FP8_SHAPES, **fp8_cases.FP8_SHAPES_OF.get(experts, {})}
    spec = CaseSpec(dispatcher="deepep_v2", experts=experts, layout=layout, mode=mode, **shapes)
    results = nccl_pool(world_size).run_ok(fp8_cases.run_fp8_case, spec, timeout_s=CASE_TIMEOUT_S)
    assert {r.dispatcher for r in results} == {"deepep_v2"}
    checks.assert_all_pass(results)


@pytest.mark.parametrize("world_size", (1, *MULTI_RANK_SIZES))
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_round_trip_is_exact(nccl_pool, world_size, mode, layout):
    spec = CaseSpec(dispatcher="deepep_v2", layout=layout, mode=mode, top_k=4, num_experts=8)
    rows = nccl_pool(world_size).run_ok(
        dispatch_cases.check_round_trip, spec, timeout_s=CASE_TIMEOUT_S
    )
    assert sum(rows) > 0


@pytest.mark.parametrize(
    ("fault", "mode"), [("id_out_of_range", "exact"), ("too_many_tokens", "capacity")]
)
def test_bad_input_on_one_rank_fails_every_rank(nccl_pool, fault, mode):
    """exact: every rank raises at once. capacity on CUDA: the bad rank raises, the others
    finish the forward (no host sync; DeepEP's dispatch and combine still run, with no rows
    from the bad rank) and raise at ``check()``, naming it. Nobody hangs."""
    spec = CaseSpec(dispatcher="deepep_v2", experts="grouped_mm", mode=mode, tokens=(5, 5))
    pool = nccl_pool(2)
    results = pool.run_ok(fault_cases.timed_bad_input, spec, 1, fault, timeout_s=CASE_TIMEOUT_S)
    argument = {"id_out_of_range": "topk_ids", "too_many_tokens": "x"}[fault]
    assert results[1][0] == "EPInputError" and results[1][1].startswith(f"{argument}:"), results
    assert results[0][0] == "RemoteRankError" and "rank 1 failed" in results[0][1], results
    run_real(pool, spec)  # the group and the buffer are still healthy
