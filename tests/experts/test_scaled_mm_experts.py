"""The ``scaled_mm`` experts backend (cuBLAS block-scaled fp8 GEMMs per expert): its adapter logic
on CPU with a stand-in for ``torch._scaled_mm`` against the fp64 oracle of the contract, and on a
Hopper GPU the real layer against the oracle and the fp8 twin (``experts="reference"``). Its row
kernels are tested in tests/experts/test_block_rows.py.

On CPU the row kernels run under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``); cuBLAS does not run there, so the stand-in below imitates only what our
adapter relies on (the shapes and strides torch checks, the block-scaled product) and never
replaces the GPU test.
"""

from __future__ import annotations

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.experts.base import ExpertsSetup
from ep_runtime.experts.gemm import block_rows
from ep_runtime.experts.scaled_mm import ScaledMMExperts
from ep_runtime.experts.triton import TritonExperts
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import (
    BLOCK,
    Fp8BlockWeights,
    dequantize_weight_blocks,
)
from ep_runtime.tolerance import compare_per_token, tolerance_for
from ep_runtime.types import DispatchMode
from tests.experts.test_fp8_triton import on_device
from tests.support import fp8_oracle
from tests.support.fp8_backend_checks import (
    ADAPTER_CASES,
    check_adapter_forward,
    check_layer_against_twin,
)
from tests.test_fp8 import fp8_inputs

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ARCH = torch.cuda.get_device_capability() if CUDA else None
HOPPER_MISSING = (
    "needs a CUDA device (Hopper)"
    if not CUDA
    else None
    if ARCH == (9, 0)
    else f"needs SM [90] (cuBLAS's 1x128/128x128 fp8 scaling), this GPU is SM{ARCH}"
)
E, K, H, I = 8, 3, 256, 128  # noqa: E741 (tests/test_fp8.py's shapes)
BIG = 512  # H and I of the cuBLAS tests: K in multiples of 4 blocks
LAYOUTS = ["standard", "expanded"]


def scaled_mm_stand_in(a, b, *, scale_a, scale_b, out_dtype, out):
    """Imitates ``torch._scaled_mm`` with 1×128 / 128×128 block scales, for our adapter logic
    only: the layouts torch checks (row-major ``a``, column-major ``b``, ``scale_a`` outer-dim
    major, ``scale_b``'s transpose row-major), then the block-scaled product in fp64."""
    (m, k), n = a.shape, b.size(1)
    assert m % block_rows.CUBLAS.align == 0  # cuBLAS had no kernel for some row counts
    assert a.is_contiguous() and b.t().is_contiguous()
    assert scale_a.shape == (m, k // BLOCK) and scale_a.stride() == (1, m)
    assert scale_b.shape == (k // BLOCK, n // BLOCK) and scale_b.t().is_contiguous()
    rows = a.double() * scale_a.double().repeat_interleave(BLOCK, dim=1)
    weight = dequantize_weight_blocks(b.t(), scale_b.t()).double()
    out.copy_((rows @ weight.t()).to(out_dtype))
    return out


def backend_with_stand_in(monkeypatch, activation: str, weights) -> ScaledMMExperts:
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_stand_in)
    config = MoEConfig(E, K, H, I, activation=activation, quantization="fp8_block")
    placement = ExpertPlacement(E, 0, 1)
    setup = ExpertsSetup(config, placement, DEVICE, torch.bfloat16, token_cap=64)
    backend = ScaledMMExperts(setup)
    q13, s13, q2, s2 = weights
    backend.load_quantized_weights(Fp8BlockWeights(q13, s13, q2, s2).to(DEVICE))
    return backend


@pytest.mark.parametrize(("layout", "activation"), ADAPTER_CASES)
def test_adapter_logic_with_a_stand_in_for_scaled_mm(monkeypatch, layout, activation):
    check_adapter_forward(
        lambda act, weights: backend_with_stand_in(monkeypatch, act, weights), layout, activation
    )


def cublas_inputs(activation: str, tokens: int = 48, seed: int = 0):
    """``fp8_inputs`` at H = I = 512 (cuBLAS takes K in multiples of 4 blocks)."""
    return fp8_inputs(activation, torch.bfloat16, tokens, seed, hidden=BIG, intermediate=BIG)


@pytest.mark.skipif(HOPPER_MISSING is not None, reason=str(HOPPER_MISSING))
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_matches_the_oracle_and_the_twin_on_hopper(layout, mode, activation):
    """cuBLAS for real: the layer against the fp64 oracle and the fp8 twin, expert row counts
    off the 16-row alignment (48 tokens, 8 experts)."""
    check_layer_against_twin("scaled_mm", cublas_inputs(activation), layout, mode, activation, 0.03)


def test_refusals_name_the_reason():
    """K/128 not a multiple of 4 (cuBLAS summed wrong there) is refused naming the size; "auto"
    leaves capacity mode (CUDA graphs) and decode-sized layers to the Triton experts, which
    take fp8 at any cap (its prefill rule compares with grouped_mm, which has no fp8 path)."""

    def setup(hidden: int, width: int, cap: int = 4096, mode=DispatchMode.EXACT) -> ExpertsSetup:
        config = MoEConfig(E, K, hidden, width, quantization="fp8_block")
        placement = ExpertPlacement(E, 0, 1)
        return ExpertsSetup(config, placement, DEVICE, torch.bfloat16, token_cap=cap, mode=mode)

    refusal = ScaledMMExperts.unavailable_reason
    assert refusal(setup(256, 512)) == (
        "hidden_size=256 is not a multiple of 512 (cuBLAS's block-scaled GEMM reads the "
        "128-column scales in fours)"
    )
    assert "intermediate_size=768 is not a multiple of 512" in str(refusal(setup(2048, 768)))
    assert refusal(setup(7168, 2048)) is None
    auto = ScaledMMExperts.auto_refusal
    assert auto(setup(7168, 2048)) is None
    assert "not a cap of 512" in str(auto(setup(7168, 2048, cap=512)))
    assert "capacity mode" in str(auto(setup(7168, 2048, mode=DispatchMode.CAPACITY)))
    if HOPPER_MISSING is None:
        assert TritonExperts.auto_refusal(setup(7168, 2048, cap=4096)) is None


@pytest.mark.skipif(HOPPER_MISSING is not None, reason=str(HOPPER_MISSING))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_edge_cases_on_hopper(dtype):
    """An expert with no rows, negative router weights (folded into cuBLAS's row scales), the
    fp32 compute dtype, then a forward where no slot is served here (exact zeros)."""
    x, ids, topk_weights, weights = cublas_inputs("silu", tokens=40, seed=1)
    ids = torch.where(ids == 5, -1, ids)  # expert 5 gets no rows
    topk_weights = torch.where(torch.arange(K) == 1, -topk_weights, topk_weights)
    q13, s13, q2, s2 = weights
    config = MoEConfig(E, K, BIG, BIG, quantization="fp8_block", dtype=dtype)
    layer = EPMoE(config, max_tokens_per_rank=40, experts="scaled_mm", device=DEVICE)
    try:
        layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        out = layer(*on_device(x.to(dtype), ids, topk_weights)).cpu()
        nobody = layer(*on_device(x.to(dtype), torch.full_like(ids, -1), topk_weights)).cpu()
    finally:
        layer.close()
    assert out.dtype == dtype
    ref, scale = fp8_oracle.fp8_moe_oracle(x, ids, topk_weights, q13, s13, q2, s2, "silu")
    comparison = compare_per_token(out, ref, tolerance_for(torch.bfloat16, BIG), scale)
    assert comparison.passed, comparison.describe()
    assert not nobody.any()
