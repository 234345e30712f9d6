"""The FlashInfer experts on their real kernels, checked per token against ``reference_moe``, for
each backend × layout × activation: directly on a hand-made ``Dispatched`` for a virtual rank
(expert offset > 0, reachable on one GPU), and through ``EPMoE`` on real ranks.

Expected skips (any other refusal fails the test, so a broken probe cannot skip everything):
- no CUDA device (CPU CI): every test here.
- flashinfer_trtllm on anything but SM100/103 (e.g. the H200 test machine, SM90):
  "needs SM [100, 103], this device is SM<arch>".
- flashinfer not importable: "flashinfer is not importable (...)".
- flashinfer_trtllm without the TRTLLM-gen cubins on disk: "TRTLLM-gen cubins are not on disk
  (...)" or "<n> of <m> TRTLLM-gen cubin files ... are missing".
- flashinfer_cutlass whose JIT module is not built (the H200 test machine: building
  ``fused_moe_90`` takes over 18 minutes): "FlashInfer's fused_moe_<arch> module is not built".
- layer tests at a world size with fewer GPUs than ranks.
"""

from __future__ import annotations

import pytest
import torch

from ep_runtime.experts import EXPERTS
from ep_runtime.experts.self_check import check_setup, make_check_problem
from ep_runtime.tolerance import compare_per_token, tolerance_for
from ep_runtime.types import Activation, TopkLayout
from tests.multigpu import layer_cases
from tests.multigpu.pool import RankFailure
from tests.multigpu.rank_inputs import CaseSpec

BACKENDS = ("flashinfer_trtllm", "flashinfer_cutlass")
EXPECTED_REFUSALS = (
    "needs SM [100, 103], this device is SM",
    "flashinfer is not importable",
    "TRTLLM-gen cubins are not on disk",
    "TRTLLM-gen cubin files listed in",
    "module is not built",
)
SHAPES = {  # virtual rank of a world, hidden, intermediate (padded by TRTLLM), top_k, tokens
    "small": dict(num_experts=6, world_size=3, rank=1, hidden=128, intermediate=96, top_k=3),
    "wider": dict(num_experts=16, world_size=4, rank=3, hidden=256, intermediate=320, top_k=4),
}
NUM_TOKENS = {"small": 12, "wider": 64}


def skip_if_refused(refusal: str | None) -> None:
    """Skip for a listed refusal; fail for any other."""
    if refusal is None:
        return
    if any(expected in refusal for expected in EXPECTED_REFUSALS):
        pytest.skip(refusal)
    pytest.fail(f"unexpected refusal: {refusal}")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("layout", list(TopkLayout))
@pytest.mark.parametrize("backend", BACKENDS)
def test_virtual_rank_matches_reference(backend, layout, activation, shape):
    setup = check_setup(activation, torch.device("cuda", 0), **SHAPES[shape])
    cls = EXPERTS[backend]
    skip_if_refused(cls.refusal(setup, layout))
    problem = make_check_problem(setup, layout, num_tokens=NUM_TOKENS[shape], seed=1)
    experts = cls(setup)
    experts.load_weights(problem.w13, problem.w2)
    hidden = problem.dispatched.hidden_states.size(1)
    served = (problem.dispatched.topk_ids >= 0).any(dim=1).cpu()  # padding rows are never read
    outputs = [experts.forward(problem.dispatched).cpu()[served] for _ in range(2)]
    tolerance = tolerance_for(torch.bfloat16, max(hidden, setup.config.intermediate_size))
    comparison = compare_per_token(outputs[0], problem.reference[served], tolerance)
    assert comparison.passed, comparison.describe()
    assert torch.equal(outputs[0], outputs[1]), "two identical runs differ"


def run_layer(pool, spec: CaseSpec, faults: tuple[str, ...] = ()):
    results = pool.run(layer_cases.run_layer_case, spec, faults)
    failures = [r for r in results if isinstance(r, RankFailure)]
    if failures:
        if all(f.type_name == "BackendUnavailableError" for f in failures):
            skip_if_refused(failures[0].message)
        raise AssertionError("\n".join(f"{f}\n{f.traceback}" for f in failures))
    return results


@needs_cuda
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_matches_reference(pool_factory, backend, layout, activation, world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} ranks need {world_size} GPUs, found {torch.cuda.device_count()}")
    spec = CaseSpec(
        experts=backend, layout=layout, activation=activation.value, hidden=128, intermediate=96
    )
    results = run_layer(pool_factory(world_size), spec)
    bad = [f"rank {r.rank}: {r.comparison.describe()}" for r in results if not r.comparison.passed]
    assert not bad, "\n".join(bad)
    assert {r.experts for r in results} == {backend}


@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_check_fails_gate_up_swapped(pool_factory, backend):
    """Negative control on the real kernel: swapped gate/up halves must fail the check."""
    spec = CaseSpec(experts=backend, hidden=128, intermediate=96)
    results = run_layer(pool_factory(1), spec, ("gate_up_swapped",))
    assert not any(r.comparison.passed for r in results), [r.comparison.describe() for r in results]
