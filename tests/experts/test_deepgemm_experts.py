"""The ``deepgemm`` experts backend (DeepGEMM's m-grouped block-scaled fp8 GEMMs): its adapter
logic on CPU with a stand-in for ``deep_gemm`` against the fp64 oracle of the contract, its
refusals, and on a Hopper GPU with DeepGEMM installed the real layer against the oracle and the
fp8 twin (``experts="reference"``), edge cases, and a capacity-mode forward replayed as a CUDA
graph. Its row kernels are tested in tests/experts/test_block_rows.py.

On CPU the row kernels run under Triton's interpreter; DeepGEMM does not run there, so the
stand-in below imitates only what our adapter relies on (the layouts DeepGEMM checks, the psum
layout's block bounds, bf16 output) and never replaces the GPU test.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.experts import EXPERTS
from ep_runtime.experts import deepgemm as deepgemm_module
from ep_runtime.experts.base import ExpertsSetup
from ep_runtime.experts.deepgemm import DeepGemmExperts
from ep_runtime.experts.gemm import block_rows
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import BLOCK, FP8_DTYPE, Fp8BlockWeights, dequantize_weight_blocks
from ep_runtime.types import DispatchMode
from tests.experts.test_fp8_triton import on_device
from tests.support.fp8_backend_checks import (
    ADAPTER_CASES,
    check_adapter_forward,
    check_layer_against_twin,
)
from tests.test_fp8 import E, H, I, K, fp8_inputs, judge

pytestmark = pytest.mark.usefixtures("triton_kernels")  # tests/conftest.py

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ARCH = torch.cuda.get_device_capability() if CUDA else None
HAS_DEEP_GEMM = importlib.util.find_spec("deep_gemm") is not None
GPU_MISSING = (
    "needs a CUDA device (Hopper)"
    if not CUDA
    else f"needs SM [90] (DeepGEMM's fp32 block scales), this GPU is SM{ARCH}"
    if ARCH != (9, 0)
    else "deep_gemm is not installed (docs/deepgemm.md)"
    if not HAS_DEEP_GEMM
    else None
)
LAYOUTS = ["standard", "expanded"]
ALIGN = block_rows.DEEPGEMM.align
# DeepGEMM writes GEMM1's output in bf16 (the backend's declared variant of the contract): the
# oracle of that variant judges it
ROUNDED = DeepGemmExperts.capabilities.gemm1_output_dtype
# per-token distance to the contract's twin (GEMM1 unrounded): the bf16 rounding moves some
# q(act) codes to a neighbour; the CPU stand-in's worst token was 0.043 (EXPANDED, one slot)
TWIN_DISTANCE = 0.06


def grouped_gemm_stand_in(a, b, d, grouped_layout, *, use_psum_layout):
    """Imitates ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` in its psum layout, for our
    adapter logic only: the layouts DeepGEMM asserts (K-major e4m3 ``a`` and ``b``, ``a``'s
    scales MN-major with a TMA-aligned stride, ``b``'s contiguous, bf16 ``d``), then each
    expert's block ``[align(end of the last, 128), end)`` in fp64. Every other row of ``d`` is
    set to NaN: nothing downstream may read it."""
    (rows, row_scales), (weight, weight_scales) = a, b
    m, k = rows.shape
    groups, n, _ = weight.shape
    assert use_psum_layout and grouped_layout.dtype == torch.int32
    assert grouped_layout.shape == (groups,) and grouped_layout.is_contiguous()
    assert rows.dtype == weight.dtype == FP8_DTYPE and rows.is_contiguous()
    assert weight.is_contiguous() and weight.shape[2] == k
    assert row_scales.shape == (m, k // BLOCK)
    assert row_scales.stride() == (1, block_rows.DEEPGEMM.scale_stride(m))
    assert weight_scales.shape == (groups, n // BLOCK, k // BLOCK) and weight_scales.is_contiguous()
    assert d.dtype == torch.bfloat16 and d.shape == (m, n) and d.is_contiguous()
    d.fill_(float("nan"))
    dequantized = rows.double() * row_scales.double().repeat_interleave(BLOCK, dim=1)
    start = 0
    for group, end in enumerate(grouped_layout.tolist()):
        assert start <= end <= m
        b_group = dequantize_weight_blocks(weight[group], weight_scales[group]).double()
        d[start:end] = (dequantized[start:end] @ b_group.t()).to(d.dtype)
        start = -(-end // ALIGN) * ALIGN


def backend_with_stand_in(monkeypatch, activation: str, weights) -> DeepGemmExperts:
    stand_in = types.ModuleType("deep_gemm")
    stand_in.m_grouped_fp8_gemm_nt_contiguous = grouped_gemm_stand_in
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    config = MoEConfig(E, K, H, I, activation=activation, quantization="fp8_block")
    setup = ExpertsSetup(config, ExpertPlacement(E, 0, 1), DEVICE, torch.bfloat16, token_cap=64)
    backend = DeepGemmExperts(setup)
    backend.load_quantized_weights(Fp8BlockWeights(*weights).to(DEVICE))
    return backend


@pytest.mark.parametrize(("layout", "activation"), ADAPTER_CASES)
def test_adapter_logic_with_a_stand_in_for_deep_gemm(monkeypatch, layout, activation):
    """Rows for every other expert only (experts without rows between those with): each expert
    with rows takes a 128-row block, every row of it a program of the row kernels, which Triton's
    interpreter runs one by one (about 30 ms each on the 2-core CI machine)."""
    check_adapter_forward(
        lambda act, weights: backend_with_stand_in(monkeypatch, act, weights),
        layout,
        activation,
        experts_with_rows=E // 2,
        gemm1_output_dtype=ROUNDED,
    )


def setup_of(cap: int = 4096, mode=DispatchMode.EXACT, dtype=torch.bfloat16) -> ExpertsSetup:
    config = MoEConfig(E, K, 7168, 2048, quantization="fp8_block")
    return ExpertsSetup(config, ExpertPlacement(E, 0, 1), DEVICE, dtype, token_cap=cap, mode=mode)


def test_declares_bf16_gemm1_output():
    """The variant the oracle judges is the one the backend declares (and the only other
    backends' declaration: none, the contract's fp32)."""
    assert torch.bfloat16 == ROUNDED
    assert EXPERTS["scaled_mm"].capabilities.gemm1_output_dtype is None
    assert EXPERTS["triton"].capabilities.gemm1_output_dtype is None


def test_refusals_name_the_reason(monkeypatch):
    """Without deep_gemm: named, with where to get it; "auto" leaves decode-sized layers to the
    Triton experts and takes capacity mode (no host read); bf16 only; CUDA only."""
    monkeypatch.setattr(deepgemm_module.importlib.util, "find_spec", lambda name: None)
    assert DeepGemmExperts.unavailable_reason(setup_of()) == (
        "deep_gemm is not installed (DeepGEMM, built from source: docs/deepgemm.md)"
    )
    monkeypatch.undo()
    auto = DeepGemmExperts.auto_refusal
    assert auto(setup_of()) is None
    assert auto(setup_of(mode=DispatchMode.CAPACITY)) is None
    assert "not a cap of 512" in str(auto(setup_of(cap=512)))
    if not CUDA:
        assert DeepGemmExperts.refusal(setup_of(), None) == "runs on ['cuda'], not cpu"
    cuda = ExpertsSetup(
        setup_of().config, ExpertPlacement(E, 0, 1), torch.device("cuda", 0), torch.float32, 64
    )
    if ARCH == (9, 0):
        assert DeepGemmExperts.refusal(cuda, None) == (
            "supports dtypes ['torch.bfloat16'], not torch.float32"
        )


def test_an_installed_deep_gemm_that_cannot_run_is_refused(monkeypatch):
    """An installed ``deep_gemm`` that does not import, lacks the m-grouped GEMM, or has no nvcc
    for its JIT is refused with that reason (so "auto" falls back instead of failing later)."""
    problem = deepgemm_module._deep_gemm_problem
    monkeypatch.setattr(deepgemm_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises
    problem.cache_clear()
    assert DeepGemmExperts.unavailable_reason(setup_of()).startswith(
        "deep_gemm does not import: ModuleNotFoundError"
    )
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    problem.cache_clear()
    assert "has no m-grouped fp8 GEMM" in DeepGemmExperts.unavailable_reason(setup_of())
    stand_in = types.ModuleType("deep_gemm")
    stand_in.m_grouped_fp8_gemm_nt_contiguous = grouped_gemm_stand_in
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    monkeypatch.setattr(deepgemm_module, "_nvcc", lambda: None)
    problem.cache_clear()
    assert DeepGemmExperts.unavailable_reason(setup_of()) == (
        "no nvcc for DeepGEMM's JIT (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"
    )
    monkeypatch.setattr(deepgemm_module, "_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    problem.cache_clear()
    assert DeepGemmExperts.unavailable_reason(setup_of()) is None
    problem.cache_clear()  # the next test sees this machine's own answer


def test_nvcc_is_looked_for_where_deep_gemm_looks(monkeypatch, tmp_path):
    """``CUDA_HOME`` first (its nvcc or none), then ``PATH``."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert deepgemm_module._nvcc() == str(nvcc)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "elsewhere"))
    assert deepgemm_module._nvcc() is None
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", str(nvcc.parent))
    assert deepgemm_module._nvcc() == str(nvcc)


def deepgemm_layer(activation: str, layout: str, mode: str, tokens: int) -> EPMoE:
    config = MoEConfig(E, K, H, I, activation=activation, quantization="fp8_block")
    return EPMoE(
        config, max_tokens_per_rank=tokens, experts="deepgemm", device=DEVICE, layout=layout,
        mode=mode,
    )  # fmt: skip


@pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))
@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_matches_the_oracle_and_the_twin_on_hopper(layout, mode, activation):
    """DeepGEMM for real: the layer against the fp64 oracle of its variant and the fp8 twin;
    experts with row counts far from 128 (48 tokens, 8 experts), a token served by nobody."""
    inputs = fp8_inputs(activation, torch.bfloat16, tokens=48)
    check_layer_against_twin(
        "deepgemm", inputs, layout, mode, activation, TWIN_DISTANCE, gemm1_output_dtype=ROUNDED
    )


@pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))
def test_edge_cases_on_hopper():
    """An expert with no rows, negative router weights (folded into GEMM2's row scales), more
    than 128 rows for one expert (two M tiles), then a forward where no slot is served here."""
    x, ids, topk_weights, weights = fp8_inputs("silu", torch.bfloat16, tokens=200, seed=1)
    ids = torch.where(ids == 5, -1, ids)  # expert 5 gets no rows
    head = ids[:150]  # expert 2 gets 150+ rows: in slot 0, its other slot's id moved there
    ids[:150] = torch.where(head == 2, head[:, :1].expand_as(head), head)
    ids[:150, 0] = 2
    topk_weights = torch.where(ids >= 0, topk_weights.nan_to_num(0.75), float("nan"))
    topk_weights = torch.where(torch.arange(K) == 1, -topk_weights, topk_weights)
    q13, s13, q2, s2 = weights
    config = MoEConfig(E, K, H, I, quantization="fp8_block")
    layer = EPMoE(config, max_tokens_per_rank=200, experts="deepgemm", device=DEVICE)
    try:
        layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        out = layer(*on_device(x, ids, topk_weights)).cpu()
        nobody = layer(*on_device(x, torch.full_like(ids, -1), topk_weights)).cpu()
    finally:
        layer.close()
    comparison = judge(out, x, ids, topk_weights, weights, "silu", gemm1_output_dtype=ROUNDED)
    assert comparison.passed, comparison.describe()
    assert not nobody.any()


@pytest.mark.skipif(GPU_MISSING is not None, reason=str(GPU_MISSING))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_capacity_forward_replays_as_a_cuda_graph(layout):
    """No host read in a forward (sync debug mode errors on one) and a captured forward replays
    to the eager result bitwise: the capability ``graph_capturable`` declares."""
    x, ids, topk_weights, weights = fp8_inputs("silu", torch.bfloat16, tokens=32, seed=2)
    q13, s13, q2, s2 = weights
    layer = deepgemm_layer("silu", layout, "capacity", tokens=32)
    try:
        layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        inputs = on_device(x, ids, topk_weights)
        eager = layer(*inputs).clone()  # compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(*inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out = torch.empty_like(eager)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(*inputs, out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        layer.check()
    finally:
        layer.close()
