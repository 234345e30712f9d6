"""The fp8 block-scale layer on real ranks (gloo on CPU, NCCL with one GPU per rank): both
layouts and modes, both activations, world sizes 1–4, global and local weight shards, edge cases,
each rank compared per token with the fp64 oracle of the contract (tests/support/fp8_oracle.py)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from ep_runtime.experts import EXPERTS
from ep_runtime.experts.triton import interpreting
from ep_runtime.quantization import Quantization
from tests.multigpu import checks, fp8_cases, rank_inputs
from tests.multigpu.expectations import INTERPRETED_MAX_WORLD_SIZE, expected_refusal
from tests.multigpu.pool import RankFailure
from tests.multigpu.rank_inputs import CaseSpec

FP8_WORLD_SIZES = (1, 2, 3, 4)


def fp8_matrix():
    """(experts, world size, layout, mode, activation) for every backend that declares fp8 block
    scales, in every activation it declares: the matrix grows when one registers."""
    for name in EXPERTS.names():
        capabilities = EXPERTS[name].capabilities
        if Quantization.FP8_BLOCK not in capabilities.quantizations:
            continue
        activations = sorted(a.value for a in capabilities.activations)
        for world_size, layout, mode, activation in itertools.product(
            FP8_WORLD_SIZES, ["standard", "expanded"], ["exact", "capacity"], activations
        ):
            if name == "triton" and interpreting() and world_size > INTERPRETED_MAX_WORLD_SIZE:
                continue
            yield pytest.param(
                name,
                world_size,
                layout,
                mode,
                activation,
                id=f"{name}-w{world_size}-{layout}-{mode}-{activation}",
            )


def fp8_spec(**changes) -> CaseSpec:
    return CaseSpec(**{**fp8_cases.FP8_SHAPES, **changes})


def run(pool, spec: CaseSpec, **options):
    """The case on every rank; skipped (with the reason) only for a refusal this machine
    predicts (tests/multigpu/expectations.py), any other failure fails."""
    results = pool.run(fp8_cases.run_fp8_case, spec, **options)
    failures = [r for r in results if isinstance(r, RankFailure)]
    if failures:
        device_type = "cuda" if pool.backend == "nccl" else "cpu"
        pattern = expected_refusal(spec.experts, device_type, spec.dtype, pool.world_size)
        refused = len(failures) == len(results) and all(
            f.type_name == "BackendUnavailableError" for f in failures
        )
        if refused and pattern and re.search(pattern, failures[0].message):
            pytest.skip(f"expected refusal: {failures[0].message}")
        raise AssertionError("\n".join(f"{f}\n{f.traceback}" for f in failures))
    assert {r.experts for r in results} == {spec.experts}
    assert {r.layout for r in results} == {spec.layout}
    checks.assert_all_pass(results)
    return results


@pytest.mark.parametrize(
    ("experts", "world_size", "layout", "mode", "activation"), list(fp8_matrix())
)
def test_fp8_layer_matches_the_oracle(pool_factory, experts, world_size, layout, mode, activation):
    spec = fp8_spec(
        experts=experts, layout=layout, mode=mode, activation=activation, num_experts=12,
        **fp8_cases.FP8_SHAPES_OF.get(experts, {}),
    )  # fmt: skip
    run(pool_factory(world_size), spec)


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_fp8_layer_in_fp32(pool_factory, layout):
    run(pool_factory(2), fp8_spec(layout=layout, dtype=torch.float32))


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_fp8_local_shards(pool_factory, layout):
    """Each rank loads its own ``[L, …]`` weights and scales: the same results as global ones."""
    pool = pool_factory(2)
    spec = fp8_spec(layout=layout)
    global_results = run(pool, spec)
    local_results = run(pool, spec, local_shards=True)
    for g, loc in zip(global_results, local_results, strict=True):
        assert torch.equal(g.output, loc.output)


@pytest.mark.parametrize(
    "edge", ["no_tokens_on_rank0", "all_slots_unused", "k_below_config_top_k", "one_token"]
)
@pytest.mark.parametrize("mode", ["exact", "capacity"])
def test_fp8_edge_cases(pool_factory, edge, mode):
    run(pool_factory(2), fp8_spec(mode=mode, **rank_inputs.EDGE_CASES[edge]))


def test_fp8_exact_mode_chunks_past_the_cap(pool_factory):
    run(pool_factory(2), fp8_spec(**rank_inputs.CHUNKED_PAST_CAP))


def test_ranks_must_agree_on_the_quantization(pool_factory):
    """A rank built with fp8 and its peers without: every rank's build fails naming it."""
    errors = pool_factory(2).run_ok(fp8_cases.build_with_quantization_on_rank0_only, fp8_spec())
    assert all(e.startswith("quantization:") for e in errors), errors
    assert all("rank 0 = fp8_block" in e and "rank 1 = none" in e for e in errors), errors
