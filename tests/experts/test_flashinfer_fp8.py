"""The FlashInfer TRTLLM fp8 block-scale adapter on CPU: weights and activations bitwise against
FlashInfer's own DeepSeek-FP8 preparation, every kernel argument through a recorder, the
self-check against the fp8 twin, and the refusals. The kernel itself has never run here (it
needs Blackwell); these test only our adapter logic."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest
import torch

# CI installs flashinfer: a skip there fails the session (tests/conftest.py); a GPU host may lack it
pytest.importorskip("flashinfer", reason="flashinfer is not installed (the `gpu` extra)")

from flashinfer.fused_moe import prepare as fused_moe_prepare
from flashinfer.fused_moe.api import QuantConfig, QuantFormat, SwiGLU

from ep_runtime.experts import EXPERTS, base
from ep_runtime.experts.flashinfer_trtllm_fp8 import FlashInferTrtllmFp8Experts
from ep_runtime.experts.self_check import FP8_CHECK_SHAPE, check_setup, make_check_problem
from ep_runtime.quantization import (
    FP8_DTYPE,
    Fp8BlockWeights,
    Quantization,
    quantize_activations,
    quantize_weight_blocks,
)
from ep_runtime.types import Activation, TopkLayout
from tests.support.flashinfer_stand_ins import (
    RecordingTrtllmKernel,
    assert_routing_arguments,
    install_trtllm,
)

CPU = torch.device("cpu")
DEEPSEEK_FP8 = QuantConfig(weight=QuantFormat.DeepSeekFp8, activation=QuantFormat.DeepSeekFp8)
MAJOR_K, DEEPSEEK_FP8_TYPE, SWIGLU, TOPK_ROUTING = 0, 1, 3, 5  # FlashInfer's enum values


pytestmark = pytest.mark.usefixtures("fresh_self_check_results")


def fp8_setup(**shape):
    return check_setup(
        Activation.SILU, CPU, **{**FP8_CHECK_SHAPE, **shape}, quantization=Quantization.FP8_BLOCK
    )


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor.view(torch.int32)


# --- weights and activations, bitwise against FlashInfer's preparation -------------------------


@pytest.mark.parametrize("intermediate", [128, 256])
def test_fp8_weights_equal_flashinfer_helper(intermediate):
    """FlashInfer quantizes its canonical ``[up; gate]`` bf16 weights itself; we quantize our
    ``[gate; up]`` copy with the contract's quantizer and convert: the same bits."""
    hidden, num_local = 256, 2
    generator = torch.Generator().manual_seed(intermediate)
    w1 = torch.randn(num_local, 2 * intermediate, hidden, generator=generator).bfloat16()
    w2 = torch.randn(num_local, hidden, intermediate, generator=generator).bfloat16()
    theirs = fused_moe_prepare.prepare_trtllm_fp8_block_weights(
        w1,
        w2,
        quant=DEEPSEEK_FP8,
        num_local_experts=num_local,
        hidden_size=hidden,
        intermediate_size=intermediate,
        activation=SwiGLU(),
    )
    gate_up = torch.cat([w1[:, intermediate:], w1[:, :intermediate]], dim=1)  # ours
    ours = fp8_backend(hidden=hidden, intermediate=intermediate).prepare_fp8_weights(
        Fp8BlockWeights(*quantize_weight_blocks(gate_up), *quantize_weight_blocks(w2))
    )
    assert ours.intermediate_size == intermediate
    assert ours.gemm1.dtype == FP8_DTYPE and ours.gemm1.shape == (
        num_local,
        2 * intermediate,
        hidden,
    )
    pairs = [
        (ours.gemm1, theirs["gemm1_weights"]),
        (ours.gemm2, theirs["gemm2_weights"]),
        (ours.kernel_args["gemm1_weights_scale"], theirs["gemm1_weights_scale"]),
        (ours.kernel_args["gemm2_weights_scale"], theirs["gemm2_weights_scale"]),
    ]
    for mine, flashinfer in pairs:
        assert mine.dtype == flashinfer.dtype and mine.shape == flashinfer.shape
        assert torch.equal(bits(mine), bits(flashinfer))


def test_bitwise_comparison_catches_a_missing_swap():
    """The comparison above can fail: without the [gate; up] -> [up; gate] swap the bits differ."""
    hidden, intermediate, num_local = 128, 128, 2
    generator = torch.Generator().manual_seed(1)
    w1 = torch.randn(num_local, 2 * intermediate, hidden, generator=generator).bfloat16()
    w2 = torch.randn(num_local, hidden, intermediate, generator=generator).bfloat16()
    theirs = fused_moe_prepare.prepare_trtllm_fp8_block_weights(
        w1,
        w2,
        quant=DEEPSEEK_FP8,
        num_local_experts=num_local,
        hidden_size=hidden,
        intermediate_size=intermediate,
    )
    unswapped = fp8_backend(hidden=hidden, intermediate=intermediate).prepare_fp8_weights(
        Fp8BlockWeights(*quantize_weight_blocks(w1), *quantize_weight_blocks(w2))
    )  # w1 is already [up; gate]: the adapter swaps it once more
    assert not torch.equal(bits(unswapped.gemm1), bits(theirs["gemm1_weights"]))
    scale1 = unswapped.kernel_args["gemm1_weights_scale"]
    assert not torch.equal(bits(scale1), bits(theirs["gemm1_weights_scale"]))


def test_fp8_activations_equal_flashinfer_helper():
    """The activations the kernel gets: FlashInfer's DeepSeek-FP8 quantization bitwise (its
    epsilon, 1e-12 on the scale, differs from the contract's 1e-10 on amax only for groups
    whose amax is below 4.5e-8: none here), scales transposed to ``[H/128, R]``."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(9, 512, generator=generator).bfloat16()
    x[3] *= 1e3
    x[4, :128] *= 1e-4
    q_theirs, scale_theirs = fused_moe_prepare.prepare_trtllm_fp8_block_activations(
        x, quant=DEEPSEEK_FP8
    )
    args = fp8_backend(hidden=512).activation_args(x)
    assert args["hidden_states"].dtype == FP8_DTYPE
    assert torch.equal(bits(args["hidden_states"]), bits(q_theirs))
    scale = args["hidden_states_scale"]
    assert scale.shape == (4, 9) and scale.is_contiguous() and scale.dtype == torch.float32
    assert torch.equal(bits(scale), bits(scale_theirs))


# --- every kernel call, through a recorder ------------------------------------------------------


def fp8_backend(**shape) -> FlashInferTrtllmFp8Experts:
    return FlashInferTrtllmFp8Experts(fp8_setup(**shape))


def fp8_problem(layout: TopkLayout):
    """The fp8 check problem (virtual rank 1 of 4, offset 2), ids handed over as a
    non-contiguous int32 view (Dispatched ids are int32: the dispatch contract)."""
    setup = fp8_setup()
    problem = make_check_problem(setup, layout)
    ids = problem.dispatched.topk_ids
    strided = torch.stack([ids, ids], dim=2)[..., 0]  # [R, K'] int32 with strides (2K', 2)
    assert not strided.is_contiguous() and strided.dtype == torch.int32
    return setup, problem, dataclasses.replace(problem.dispatched, topk_ids=strided)


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_fp8_call_arguments(monkeypatch, layout):
    kernel = RecordingTrtllmKernel()
    install_trtllm(monkeypatch, kernel)
    setup, problem, dispatched = fp8_problem(layout)
    backend = FlashInferTrtllmFp8Experts(setup)
    backend.load_quantized_weights(problem.fp8)
    result = backend.forward(dispatched)

    ((args, kw),) = kernel.calls
    assert args == ()
    assert isinstance(kw["topk_ids"], tuple) and len(kw["topk_ids"]) == 2
    assert_routing_arguments(*kw["topk_ids"], dispatched)
    assert kw["top_k"] == dispatched.topk_ids.size(1) == (1 if layout is TopkLayout.EXPANDED else 3)
    assert kw["num_experts"] == 8 and kw["local_num_experts"] == 2
    assert kw["local_expert_offset"] == 2 and kw["intermediate_size"] == 128
    assert kw["activation_type"] == SWIGLU and kw["routing_method_type"] == TOPK_ROUTING
    assert kw["use_shuffled_weight"] is False and kw["weight_layout"] == MAJOR_K
    assert int(kw["fp8_quantization_type"]) == DEEPSEEK_FP8_TYPE
    assert kw["routing_bias"] is None and kw["routed_scaling_factor"] is None
    assert kw["n_group"] is None and kw["topk_group"] is None
    q, scale = quantize_activations(dispatched.hidden_states)
    assert torch.equal(bits(kw["hidden_states"]), bits(q))  # NaN padding rows included
    assert kw["hidden_states_scale"].shape == (1, dispatched.hidden_states.size(0))
    assert torch.equal(kw["hidden_states_scale"].nan_to_num(7.0), scale.t().nan_to_num(7.0))
    w13 = problem.fp8.w13
    assert torch.equal(bits(kw["gemm1_weights"][:, :128]), bits(w13[:, 128:]))  # up first
    assert torch.equal(bits(kw["gemm1_weights"][:, 128:]), bits(w13[:, :128]))
    assert kw["gemm1_weights_scale"].shape == (2, 2, 1) and kw["gemm2_weights_scale"].shape == (
        2,
        1,
        1,
    )
    assert kw["output"] is result and result.dtype == torch.bfloat16


def test_fp8_empty_input_makes_no_call(monkeypatch):
    kernel = RecordingTrtllmKernel()
    install_trtllm(monkeypatch, kernel)
    setup, problem, dispatched = fp8_problem(TopkLayout.STANDARD)
    backend = FlashInferTrtllmFp8Experts(setup)
    backend.load_quantized_weights(problem.fp8)
    empty = dataclasses.replace(
        dispatched,
        hidden_states=dispatched.hidden_states[:0],
        topk_ids=dispatched.topk_ids[:0],
        topk_weights=dispatched.topk_weights[:0],
    )
    assert backend.forward(empty).shape == (0, 128) and kernel.calls == []


def test_fp8_backend_takes_no_unquantized_weights():
    setup, problem, _ = fp8_problem(TopkLayout.STANDARD)
    with pytest.raises(TypeError, match="load_quantized_weights"):
        FlashInferTrtllmFp8Experts(setup).load_weights(problem.w13, problem.w2)


# --- the self-check against the fp8 twin --------------------------------------------------------


class EmulatedFp8Kernel(RecordingTrtllmKernel):
    """A correct stand-in for the fp8 kernel, to test the self-check logic only: it decodes our
    arguments (transposed activation scales, [up; gate] weights) and runs the fp8 twin."""

    def __call__(self, **kw):
        from ep_runtime.experts.reference import fp8_block_expert_ffn

        self.calls.append(((), kw))
        ids, weights = kw["topk_ids"]
        x = kw["hidden_states"].float() * kw["hidden_states_scale"].t().repeat_interleave(128, 1)
        local = ids.long() - kw["local_expert_offset"]
        w13, s13 = kw["gemm1_weights"], kw["gemm1_weights_scale"]
        out = torch.zeros(x.shape)
        for expert in range(kw["local_num_experts"]):
            rows, slots = (local == expert).nonzero(as_tuple=True)
            gate_up = torch.cat(w13[expert].chunk(2)[::-1]), torch.cat(s13[expert].chunk(2)[::-1])
            y = fp8_block_expert_ffn(
                x[rows],
                *gate_up,
                kw["gemm2_weights"][expert],
                kw["gemm2_weights_scale"][expert],
                "silu",
            )
            out.index_add_(0, rows, weights[rows, slots].unsqueeze(1) * y)
        kw["output"].copy_(out)
        return kw["output"]


def test_self_check_refuses_a_wrong_kernel_with_numbers(monkeypatch, probes_pass):
    kernel = RecordingTrtllmKernel()  # writes zeros
    install_trtllm(monkeypatch, kernel)
    setup = fp8_setup()
    reason = FlashInferTrtllmFp8Experts.unavailable_reason(setup)
    assert reason.startswith("self-check against the fp8 twin failed")
    assert "virtual rank 1 of 4" in reason and "tolerance" in reason
    calls = len(kernel.calls)
    assert (
        FlashInferTrtllmFp8Experts.unavailable_reason(setup) == reason
        and len(kernel.calls) == calls
    )


def test_self_check_passes_a_correct_kernel_once(monkeypatch, probes_pass):
    kernel = EmulatedFp8Kernel()
    install_trtllm(monkeypatch, kernel)
    setup = fp8_setup()
    assert FlashInferTrtllmFp8Experts.unavailable_reason(setup) is None
    assert FlashInferTrtllmFp8Experts.unavailable_reason(setup) is None
    assert len(kernel.calls) == len(TopkLayout)


def test_routing_needs_experts_in_fours():
    reason = FlashInferTrtllmFp8Experts.unavailable_reason(fp8_setup(num_experts=6, world_size=3))
    assert reason == "num_experts=6 is not a multiple of 4 (TRTLLM-gen's routing kernel)"


# --- refusals -----------------------------------------------------------------------------------


def test_registered_with_capabilities():
    cls = EXPERTS["flashinfer_trtllm_fp8"]
    assert cls is FlashInferTrtllmFp8Experts
    assert cls.capabilities.quantizations == {Quantization.FP8_BLOCK}
    assert cls.capabilities.cuda_archs == {100, 103}
    assert cls.capabilities.activations == {Activation.SILU}
    assert cls.capabilities.dtypes == {torch.bfloat16}
    assert EXPERTS["reference"].capabilities.quantizations == {None, Quantization.FP8_BLOCK}
    for name in ("grouped_mm", "flashinfer_trtllm", "flashinfer_cutlass"):
        assert EXPERTS[name].capabilities.quantizations == {None}


def test_refused_for_unquantized_and_relu2_layers(monkeypatch):
    monkeypatch.setattr(base, "cuda_arch", lambda device: 100)
    setup = fp8_setup()
    cuda = dataclasses.replace(setup, device=torch.device("cuda", 0))
    unquantized = dataclasses.replace(
        cuda, config=dataclasses.replace(setup.config, quantization=None)
    )
    assert FlashInferTrtllmFp8Experts.refusal(unquantized, None) == (
        "supports quantizations ['fp8_block'], not None"
    )
    relu2 = dataclasses.replace(cuda, config=dataclasses.replace(setup.config, activation="relu2"))
    assert FlashInferTrtllmFp8Experts.refusal(relu2, None) == (
        "supports activations ['silu'], not relu2"
    )


def test_refused_on_sm90_in_under_a_millisecond_without_importing_flashinfer():
    code = (
        "import sys, time, torch\n"
        "from ep_runtime.experts import EXPERTS, base\n"
        "from ep_runtime.experts.self_check import check_setup\n"
        "from ep_runtime.quantization import Quantization\n"
        "from ep_runtime.types import Activation\n"
        "base.cuda_arch = lambda device: 90  # an H200, as the capability check sees it\n"
        "setup = check_setup(Activation.SILU, torch.device('cpu'), num_experts=8, world_size=4,\n"
        "                    intermediate=128, quantization=Quantization.FP8_BLOCK)\n"
        "import dataclasses\n"
        "setup = dataclasses.replace(setup, device=torch.device('cuda', 0))\n"
        "cls = EXPERTS['flashinfer_trtllm_fp8']\n"
        "start = time.perf_counter()\n"
        "reason = cls.refusal(setup, None)\n"
        "elapsed = time.perf_counter() - start\n"
        "assert elapsed < 1e-3, elapsed\n"
        "assert 'flashinfer' not in sys.modules\n"
        "print(reason)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "needs SM [100, 103], this device is SM90"


def test_refused_on_cpu_at_once():
    setup = fp8_setup()
    times = []
    for _ in range(5):  # the best of five: a loaded CI machine only ever adds time
        start = time.perf_counter()
        reason = FlashInferTrtllmFp8Experts.refusal(setup, None)
        times.append(time.perf_counter() - start)
        assert reason == "runs on ['cuda'], not cpu"
    assert min(times) < 1e-3, times
