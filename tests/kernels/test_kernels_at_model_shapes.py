"""The Triton data-path ops against their torch twins at model shapes (CUDA only): the cases
``python -m ep_runtime.bench.kernels`` times, each checked bitwise (silu: 2 ulp) before timing.

Without a GPU only a small shape runs, under Triton's interpreter on CPU tensors: it checks the
cases themselves (inputs, outputs compared). tests/kernels/test_kernels.py covers odd shapes and
edge
cases of every op; this file covers the sizes the benchmarks and the models use.
"""

from __future__ import annotations

import pytest
import torch

from ep_runtime.bench.kernels import SHAPES, Shape, op_cases, same_bits, within_ulps

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

CUDA = torch.cuda.is_available()
SMALL = Shape("small", num_experts=16, world=2, tokens=24, hidden=128, intermediate=32, top_k=4)


@pytest.mark.parametrize("shape", [SMALL, *SHAPES], ids=lambda shape: shape.name)
def test_triton_ops_match_their_twins(shape: Shape) -> None:
    if shape is not SMALL and not CUDA:
        pytest.skip("needs a CUDA device (model shapes)")
    cases = op_cases(shape, torch.device("cuda" if CUDA else "cpu"))
    assert len(cases) == 14
    mismatched = [f"{case.op} {case.variant}" for case in cases if not case.matches()]
    assert not mismatched, f"{shape.name}: Triton differs from the torch twin in {mismatched}"


def test_the_comparisons_catch_one_changed_element() -> None:
    """Negative control of ``same_bits`` / ``within_ulps``; a NaN matches any NaN."""
    a = torch.randn(64, 8).to(torch.bfloat16)
    b = a.clone()
    b[3, 5] = -b[3, 5] if b[3, 5] != 0 else 1.0
    assert same_bits(a, a.clone()) and not same_bits(a, b) and not same_bits(a, a.float())
    nans = torch.full((4,), float("nan"), dtype=torch.bfloat16)
    assert same_bits(nans, nans.neg())
    assert within_ulps(a, a.clone(), 2) and not within_ulps(b, a, 2)
