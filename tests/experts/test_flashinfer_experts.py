"""FlashInfer experts adapters, on CPU: weight preparation against FlashInfer's own helper
(bitwise) and every kernel call's arguments through recorders. The self-check, the CUTLASS JIT
policy and the availability probes: tests/experts/test_flashinfer_self_check.py; the kernels
themselves
run in tests/multigpu/test_flashinfer_real.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

# CI installs flashinfer: a skip there fails the session (tests/conftest.py); a GPU host may lack it
pytest.importorskip("flashinfer", reason="flashinfer is not installed (the `gpu` extra)")

from flashinfer.fused_moe import prepare as fused_moe_prepare
from flashinfer.fused_moe.api import ReLU2, SwiGLU
from flashinfer.fused_moe.core import convert_to_block_layout
from flashinfer.utils import get_shuffle_matrix_a_row_indices

from ep_runtime.experts import self_check
from ep_runtime.experts.flashinfer_common import kernel_routing, pad_intermediate
from ep_runtime.experts.flashinfer_cutlass import FlashInferCutlassExperts
from ep_runtime.experts.flashinfer_trtllm import FlashInferTrtllmExperts
from ep_runtime.experts.self_check import CHECK_TOKEN_CAP, check_setup, make_check_problem
from ep_runtime.reference import expert_ffn
from ep_runtime.types import Activation, TopkLayout
from tests.support.flashinfer_stand_ins import (
    RecordingCutlassKernel,
    RecordingTrtllmKernel,
    assert_routing_arguments,
    install_cutlass,
    install_trtllm,
    random_weights,
)

pytestmark = pytest.mark.usefixtures("fresh_self_check_results")

CPU = torch.device("cpu")
SWIGLU, RELU2, BLOCK_MAJOR_K = 3, 6, 2  # FlashInfer's documented enum values
EXPECTED_ACTIVATION = {Activation.SILU: SWIGLU, Activation.RELU2: RELU2}


def flashinfer_canonical(w13, w2, activation: Activation, padded: int):
    """FlashInfer's input convention, built here by hand: ``[up; gate]``, I zero-padded."""
    num_local, _, hidden = w13.shape
    intermediate = w2.size(2)
    halves = [w13[:, intermediate:], w13[:, :intermediate]] if activation.is_gated else [w13]
    w1 = torch.zeros(num_local, len(halves) * padded, hidden, dtype=w13.dtype)
    for index, half in enumerate(halves):
        w1[:, index * padded : index * padded + intermediate] = half
    w2_padded = torch.zeros(num_local, hidden, padded, dtype=w2.dtype)
    w2_padded[:, :, :intermediate] = w2
    return w1, w2_padded


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def trtllm_backend(activation: Activation, hidden: int, intermediate: int, **kwargs):
    setup = check_setup(activation, CPU, hidden=hidden, intermediate=intermediate, **kwargs)
    return FlashInferTrtllmExperts(setup)


# --- 1. weight preparation, bitwise against FlashInfer's prepare_trtllm_bf16_weights ----------


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("intermediate", [128, 96, 200])  # aligned, padded to 128, to 256
def test_trtllm_weights_equal_flashinfer_helper(activation: Activation, intermediate: int):
    hidden, num_local = 256, 2
    torch.manual_seed(intermediate)
    w13, w2 = random_weights(activation, num_local, hidden, intermediate)
    ours = trtllm_backend(activation, hidden, intermediate).prepare_weights(w13, w2)

    padded = -(-intermediate // 128) * 128
    w1_fi, w2_fi = flashinfer_canonical(w13, w2, activation, padded)
    theirs = fused_moe_prepare.prepare_trtllm_bf16_weights(
        w1_fi,
        w2_fi,
        num_local_experts=num_local,
        hidden_size=hidden,
        intermediate_size=padded,
        activation=SwiGLU() if activation.is_gated else ReLU2(),
        permute_cache={},
    )
    rows = 2 * padded if activation.is_gated else padded
    assert ours.intermediate_size == padded
    assert ours.gemm1.shape == (num_local, hidden // 64, rows, 64)
    assert ours.gemm2.shape == (num_local, padded // 64, hidden, 64)
    assert torch.equal(bits(ours.gemm1), bits(theirs["gemm1_weights"]))
    assert torch.equal(bits(ours.gemm2), bits(theirs["gemm2_weights"]))


def test_bitwise_comparison_catches_a_missing_reorder_or_swap():
    """The comparison above can fail: a shuffle without the gated reorder, or no [gate; up] ->
    [up; gate] swap, gives different bits."""
    hidden, intermediate, num_local = 128, 128, 2
    torch.manual_seed(1)
    w13, w2 = random_weights(Activation.SILU, num_local, hidden, intermediate)
    ours = trtllm_backend(Activation.SILU, hidden, intermediate).prepare_weights(w13, w2)
    w1_fi, _ = flashinfer_canonical(w13, w2, Activation.SILU, intermediate)
    shuffle_only = torch.stack(
        [
            convert_to_block_layout(
                w.view(torch.uint8)[get_shuffle_matrix_a_row_indices(w.view(torch.uint8), 128)],
                128,
            )
            for w in w1_fi
        ]
    ).view(torch.bfloat16)
    assert shuffle_only.shape == ours.gemm1.shape
    assert not torch.equal(bits(shuffle_only), bits(ours.gemm1))
    unswapped = fused_moe_prepare.prepare_trtllm_bf16_weights(
        w13,
        w2,
        num_local_experts=num_local,
        hidden_size=hidden,
        intermediate_size=intermediate,
        permute_cache={},
    )
    assert not torch.equal(bits(unswapped["gemm1_weights"]), bits(ours.gemm1))


@pytest.mark.parametrize("activation", list(Activation))
def test_padding_keeps_results(activation: Activation):
    hidden, intermediate, num_local = 64, 96, 2
    torch.manual_seed(2)
    w13, w2 = random_weights(activation, num_local, hidden, intermediate)
    w13_p, w2_p, padded = pad_intermediate(w13, w2, 128, activation.is_gated)
    assert padded == 128 and w2_p.shape == (num_local, hidden, 128)
    if activation.is_gated:  # [gate, 0; up, 0]
        assert torch.equal(w13_p[:, :intermediate], w13[:, :intermediate])
        assert torch.equal(w13_p[:, 128 : 128 + intermediate], w13[:, intermediate:])
        assert not w13_p[:, intermediate:128].any() and not w13_p[:, 128 + intermediate :].any()
    x = torch.randn(5, hidden, dtype=torch.float64)
    for expert in range(num_local):
        before = expert_ffn(x, w13[expert].double(), w2[expert].double(), activation.value)
        after = expert_ffn(x, w13_p[expert].double(), w2_p[expert].double(), activation.value)
        torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)


# --- 2. every kernel call, through recorders ---------------------------------------------------


def contract_problem(activation: Activation, layout: TopkLayout, **kwargs):
    """The check problem for virtual rank 1 of 3, with ids handed over as a non-contiguous view."""
    setup = check_setup(activation, CPU, **kwargs)
    problem = make_check_problem(setup, layout)
    ids = problem.dispatched.topk_ids
    strided = torch.stack([ids, ids], dim=2)[..., 0]  # [R, K'] int32 with strides (2K', 2)
    assert not strided.is_contiguous() and strided.dtype == torch.int32
    return setup, problem, dataclasses.replace(problem.dispatched, topk_ids=strided)


def test_kernel_routing_refuses_ids_off_the_int32_contract():
    """Dispatched ids are int32 (types.Dispatched): other widths are a dispatcher's bug, named
    here, not cast."""
    _, _, dispatched = contract_problem(Activation.SILU, TopkLayout.STANDARD)
    wide = dataclasses.replace(dispatched, topk_ids=dispatched.topk_ids.to(torch.int64))
    with pytest.raises(TypeError, match="int32"):
        kernel_routing(wide)


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("layout", list(TopkLayout))
def test_trtllm_call_arguments(monkeypatch, skip_self_check, activation, layout):
    kernel = RecordingTrtllmKernel()
    install_trtllm(monkeypatch, kernel)
    setup, problem, dispatched = contract_problem(activation, layout)
    backend = FlashInferTrtllmExperts(setup)
    backend.load_weights(problem.w13, problem.w2)
    result = backend.forward(dispatched)

    assert len(kernel.calls) == 1
    args, kw = kernel.calls[0]
    assert args == ()  # all keywords: variants add arguments, not another call
    assert isinstance(kw["topk_ids"], tuple) and len(kw["topk_ids"]) == 2
    assert_routing_arguments(*kw["topk_ids"], dispatched)
    top_k = 1 if layout is TopkLayout.EXPANDED else self_check.CHECK_TOP_K
    assert kw["top_k"] == dispatched.topk_ids.size(1) == top_k
    assert kw["activation_type"] == EXPECTED_ACTIVATION[activation]
    assert kw["use_shuffled_weight"] is True and kw["weight_layout"] == BLOCK_MAJOR_K
    assert kw["intermediate_size"] == 128  # 96 padded
    rows = 256 if activation.is_gated else 128
    assert kw["gemm1_weights"].shape == (2, 128 // 64, rows, 64)
    assert kw["gemm2_weights"].shape == (2, 128 // 64, 128, 64)
    assert kw["gemm1_weights"].dtype == torch.bfloat16
    assert kw["num_experts"] == 6 and kw["local_num_experts"] == 2
    assert kw["local_expert_offset"] == 2  # rank 1 · L
    assert kw["n_group"] is None and kw["topk_group"] is None
    assert kw["output"] is result and result.shape == dispatched.hidden_states.shape
    assert kw["hidden_states"].is_contiguous()
    nan_as_7 = dispatched.hidden_states.nan_to_num(7.0)  # padding rows hold NaN
    assert torch.equal(kw["hidden_states"].nan_to_num(7.0), nan_as_7)


def test_trtllm_empty_input_makes_no_call(monkeypatch, skip_self_check):
    kernel = RecordingTrtllmKernel()
    install_trtllm(monkeypatch, kernel)
    setup, problem, dispatched = contract_problem(Activation.SILU, TopkLayout.STANDARD)
    backend = FlashInferTrtllmExperts(setup)
    backend.load_weights(problem.w13, problem.w2)
    empty = dataclasses.replace(
        dispatched,
        hidden_states=dispatched.hidden_states[:0],
        topk_ids=dispatched.topk_ids[:0],
        topk_weights=dispatched.topk_weights[:0],
    )
    assert backend.forward(empty).shape == (0, 128)
    assert kernel.calls == []


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("layout", list(TopkLayout))
def test_cutlass_call_arguments(monkeypatch, skip_self_check, activation, layout):
    kernel = RecordingCutlassKernel()
    install_cutlass(monkeypatch, kernel)
    setup, problem, dispatched = contract_problem(activation, layout, intermediate=100)
    backend = FlashInferCutlassExperts(setup)
    backend.load_weights(problem.w13, problem.w2)
    results = [backend.forward(dispatched) for _ in range(2)]

    assert len(kernel.calls) == 2
    (args, kw), (_, kw_again) = kernel.calls
    assert args == ()
    assert_routing_arguments(kw["token_selected_experts"], kw["token_final_scales"], dispatched)
    assert kw["token_selected_experts"].size(1) == dispatched.topk_ids.size(1)
    assert kw["ep_size"] == 3 and kw["ep_rank"] == 1
    assert kw["enable_alltoall"] is False
    assert kw["use_fused_finalize"] is False
    assert int(kw["activation_type"]) == EXPECTED_ACTIVATION[activation]
    assert kw["quant_scales"] == [] and kw["output_dtype"] == torch.bfloat16
    assert kw["output"] is results[0] and kw_again["output"] is results[1]
    assert results[0] is not results[1]  # a fresh output per call
    # [up; gate], each half padded 100 -> 104
    w13, w2 = problem.w13, problem.w2
    fc1, fc2 = kw["fc1_expert_weights"], kw["fc2_expert_weights"]
    assert fc2.shape == (2, 128, 104) and torch.equal(fc2[:, :, :100], w2)
    assert not fc2[:, :, 100:].any()
    if activation.is_gated:
        assert fc1.shape == (2, 208, 128)
        assert torch.equal(fc1[:, :100], w13[:, 100:]) and torch.equal(
            fc1[:, 104:204], w13[:, :100]
        )
    else:
        assert fc1.shape == (2, 104, 128) and torch.equal(fc1[:, :100], w13)
    # one workspace, sized once (rows = max(R, W · cap)), reused by the second call
    assert kw["workspace_buffer"] is kw_again["workspace_buffer"]
    assert len(kernel.workspace_calls) == 1
    ((ws_args, ws_kw),) = kernel.workspace_calls
    assert ws_args == (3 * CHECK_TOKEN_CAP, 128, 104, 6, 3)
    assert ws_kw["ep_size"] == 3 and ws_kw["ep_rank"] == 1
    assert ws_kw["use_fused_finalize"] is False
    assert kw["workspace_buffer"].numel() == 1000 + 3 * CHECK_TOKEN_CAP


def test_cutlass_workspace_grows_only_past_its_size(monkeypatch, skip_self_check):
    kernel = RecordingCutlassKernel()
    install_cutlass(monkeypatch, kernel)
    setup = check_setup(Activation.SILU, CPU)
    setup = dataclasses.replace(setup, token_cap=1)  # W · cap = 3 rows: below the problems'
    small = make_check_problem(setup, TopkLayout.STANDARD, num_tokens=12)
    large = make_check_problem(setup, TopkLayout.STANDARD, num_tokens=40)
    backend = FlashInferCutlassExperts(setup)
    backend.load_weights(small.w13, small.w2)
    for problem in (small, small, large, small):
        backend.forward(problem.dispatched)
    assert [call[0][0] for call in kernel.workspace_calls] == [12, 40]
    buffers = [kw["workspace_buffer"] for _, kw in kernel.calls]
    assert buffers[0] is buffers[1] and buffers[2] is buffers[3] and buffers[1] is not buffers[2]
