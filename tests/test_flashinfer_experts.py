"""FlashInfer experts adapters, on CPU: weight preparation against FlashInfer's own helper
(bitwise), every kernel call's arguments through recorders, the self-check run when a backend is
considered for a layer, the CUTLASS JIT policy, and the availability probes. The kernels
themselves run in tests/multigpu/test_flashinfer_real.py."""

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
from flashinfer.fused_moe.api import ReLU2, SwiGLU
from flashinfer.fused_moe.core import convert_to_block_layout
from flashinfer.utils import get_shuffle_matrix_a_row_indices

from ep_runtime.experts import EXPERTS, flashinfer_cutlass, flashinfer_trtllm, self_check
from ep_runtime.experts.flashinfer_common import kernel_routing, pad_intermediate
from ep_runtime.experts.flashinfer_cutlass import FlashInferCutlassExperts
from ep_runtime.experts.flashinfer_trtllm import FlashInferTrtllmExperts, gemm1_row_order
from ep_runtime.experts.self_check import CHECK_TOKEN_CAP, check_setup, make_check_problem
from ep_runtime.reference import expert_ffn, reference_moe
from ep_runtime.types import Activation, Dispatched, TopkLayout

CPU = torch.device("cpu")
SWIGLU, RELU2, BLOCK_MAJOR_K = 3, 6, 2  # FlashInfer's documented enum values
EXPECTED_ACTIVATION = {Activation.SILU: SWIGLU, Activation.RELU2: RELU2}


class RecordingTrtllmKernel:
    """Stand-in for ``trtllm_bf16_routed_moe``, used only to test our adapter's arguments: it
    records every call and writes zeros into ``output`` (not a result). Never a substitute for
    the real-kernel test."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        kwargs["output"].zero_()
        return kwargs["output"]


class RecordingCutlassKernel:
    """Stand-in for ``cutlass_fused_moe`` and ``cutlass_fused_moe_workspace_size``, used only to
    test our adapter's arguments: it records every call, writes zeros into ``output`` and sizes
    the workspace as ``1000 + rows`` bytes. Never a substitute for the real-kernel test."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.workspace_calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        kwargs["output"].zero_()
        return [kwargs["output"]]

    def workspace_size(self, *args, **kwargs) -> int:
        self.workspace_calls.append((args, kwargs))
        return 1000 + args[0]


@pytest.fixture(autouse=True)
def fresh_self_check_results(monkeypatch):
    monkeypatch.setattr(self_check, "_results", {})


@pytest.fixture
def skip_self_check(monkeypatch):
    monkeypatch.setenv(self_check.SKIP_ENV, "1")


def install_trtllm(monkeypatch, kernel) -> None:
    monkeypatch.setattr(flashinfer_trtllm, "trtllm_kernel", lambda name: kernel)


def install_cutlass(monkeypatch, kernel) -> None:
    monkeypatch.setattr(
        flashinfer_cutlass, "cutlass_kernels", lambda: (kernel, kernel.workspace_size)
    )


@pytest.fixture
def probes_pass(monkeypatch):
    """The availability probes that read the disk or a CUDA device answer "present" (TRTLLM
    cubins, CUTLASS module), so ``unavailable_reason`` reaches the self-check on CPU."""
    monkeypatch.setattr(flashinfer_trtllm, "trtllm_cubins_missing_reason", lambda: None)
    monkeypatch.setattr(FlashInferCutlassExperts, "_module_missing_reason", lambda setup: None)


def random_weights(activation: Activation, num_local: int, hidden: int, intermediate: int):
    rows = 2 * intermediate if activation.is_gated else intermediate
    w13 = torch.randn(num_local, rows, hidden).to(torch.bfloat16)
    w2 = torch.randn(num_local, hidden, intermediate).to(torch.bfloat16)
    return w13, w2


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


def assert_routing_arguments(ids: torch.Tensor, weights: torch.Tensor, dispatched: Dispatched):
    expected_ids = dispatched.topk_ids
    assert ids.dtype == torch.int32 and ids.is_contiguous()
    assert torch.equal(ids.to(torch.int64), expected_ids)
    assert weights.dtype == torch.float32 and weights.is_contiguous()
    used = expected_ids >= 0
    assert torch.equal(weights[used], dispatched.topk_weights[used])
    assert not weights[~used].any()  # exact zeros, NaN gone
    assert (~used).any() and torch.isnan(dispatched.topk_weights[~used]).all()


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


# --- 3. the self-check, run when a backend is considered for a layer ----------------------------


def emulated_moe(hidden, ids, weights, w13, w2, offset, activation, output):
    """What a correct kernel computes: Σ over slots with a local id of w · FFN(x), into output."""
    num_local = w13.size(0)
    local = ids.to(torch.int64) - offset
    local = torch.where((ids >= 0) & (local >= 0) & (local < num_local), local, -1)
    output.copy_(reference_moe(hidden, local, weights, w13, w2, activation.value))
    return output


class EmulatedCutlassKernel(RecordingCutlassKernel):
    """A correct stand-in (or one that ignores ``ep_rank``), to test the self-check logic."""

    def __init__(self, activation: Activation, ignore_rank: bool = False) -> None:
        super().__init__()
        self.activation, self.ignore_rank = activation, ignore_rank

    def __call__(self, **kw):
        self.calls.append(((), kw))
        fc1 = kw["fc1_expert_weights"]
        if self.activation.is_gated:  # back to [gate; up]
            fc1 = torch.cat(fc1.chunk(2, dim=1)[::-1], dim=1)
        offset = 0 if self.ignore_rank else kw["ep_rank"] * fc1.size(0)
        ids, weights = kw["token_selected_experts"], kw["token_final_scales"]
        fc2 = kw["fc2_expert_weights"]
        return emulated_moe(
            kw["input"], ids, weights, fc1, fc2, offset, self.activation, kw["output"]
        )


class EmulatedTrtllmKernel(RecordingTrtllmKernel):
    """A correct stand-in that decodes the prepared layout, to test the self-check logic."""

    def __init__(self, activation: Activation) -> None:
        super().__init__()
        self.activation = activation

    def __call__(self, **kw):
        self.calls.append(((), kw))
        ids, weights = kw["topk_ids"]
        gemm1, gemm2 = kw["gemm1_weights"], kw["gemm2_weights"]
        w13 = unblock(gemm1)
        w13[:, gemm1_row_order(w13.size(1), self.activation.is_gated)] = w13.clone()
        w2 = unblock(gemm2)
        w2[:, flashinfer_trtllm.shuffle_row_order(w2.size(1))] = w2.clone()
        return emulated_moe(
            kw["hidden_states"],
            ids,
            weights,
            w13,
            w2,
            kw["local_expert_offset"],
            self.activation,
            kw["output"],
        )


def unblock(weights: torch.Tensor) -> torch.Tensor:
    """``[L, K/b, M, b]`` → ``[L, M, K]``."""
    num_local, blocks, rows, block = weights.shape
    return weights.permute(0, 2, 1, 3).reshape(num_local, rows, blocks * block)


def load_real_weights(backend_cls, activation: Activation):
    setup = check_setup(activation, CPU, hidden=256, intermediate=64, rank=0, world_size=2)
    backend = backend_cls(setup)
    w13, w2 = random_weights(activation, 3, 256, 64)
    backend.load_weights(w13, w2)
    return setup


def selection_setup(activation: Activation):
    return check_setup(activation, CPU, hidden=256, intermediate=64)


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("backend_cls", [FlashInferTrtllmExperts, FlashInferCutlassExperts])
def test_self_check_refuses_a_wrong_kernel_with_numbers(
    monkeypatch, probes_pass, backend_cls, activation
):
    trtllm, cutlass = RecordingTrtllmKernel(), RecordingCutlassKernel()  # zeros: wrong
    install_trtllm(monkeypatch, trtllm)
    install_cutlass(monkeypatch, cutlass)
    setup = selection_setup(activation)
    reason = backend_cls.unavailable_reason(setup)
    assert "self-check against reference_moe failed" in reason
    assert "max per-token relative error" in reason and "tolerance" in reason
    assert self_check.SKIP_ENV in reason
    calls = len(trtllm.calls) + len(cutlass.calls)
    assert calls >= 1
    assert backend_cls.unavailable_reason(setup) == reason  # remembered: "auto" skips it
    assert len(trtllm.calls) + len(cutlass.calls) == calls  # without running it again


@pytest.mark.parametrize("activation", list(Activation))
def test_self_check_passes_correct_kernels_once(monkeypatch, probes_pass, activation):
    trtllm, cutlass = EmulatedTrtllmKernel(activation), EmulatedCutlassKernel(activation)
    install_trtllm(monkeypatch, trtllm)
    install_cutlass(monkeypatch, cutlass)
    setup = selection_setup(activation)
    for backend_cls in (FlashInferTrtllmExperts, FlashInferCutlassExperts):
        assert backend_cls.unavailable_reason(setup) is None
        assert backend_cls.unavailable_reason(setup) is None  # the check does not rerun
    assert len(trtllm.calls) == len(cutlass.calls) == len(TopkLayout)


def test_self_check_runs_at_selection_not_at_load(monkeypatch, probes_pass):
    """Loading weights runs no kernel; considering the backend for a layer does (both
    layouts), so the first layer already gets the verdict."""
    kernel = EmulatedTrtllmKernel(Activation.SILU)
    install_trtllm(monkeypatch, kernel)
    load_real_weights(FlashInferTrtllmExperts, Activation.SILU)
    assert kernel.calls == []
    assert FlashInferTrtllmExperts.unavailable_reason(selection_setup(Activation.SILU)) is None
    assert len(kernel.calls) == len(TopkLayout)


@pytest.mark.parametrize("shape", [{}, dict(num_experts=16, world_size=4, rank=3, top_k=4)])
@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("name", ["reference", "grouped_mm"])
def test_check_problem_passes_the_torch_backends(name, activation, shape):
    """The check problem and its oracle agree with backends that run here (both layouts)."""
    setup = check_setup(activation, CPU, **shape)
    assert self_check.check_backend(EXPERTS[name], setup) is None


def test_self_check_refuses_a_kernel_that_ignores_the_rank_offset(monkeypatch):
    install_cutlass(monkeypatch, EmulatedCutlassKernel(Activation.SILU, ignore_rank=True))
    reason = self_check.self_check_refusal(FlashInferCutlassExperts, CPU, Activation.SILU)
    assert reason is not None and "virtual rank 1 of 3" in reason


def test_self_check_refuses_a_kernel_that_raises(monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("no kernel image for this device")

    install_trtllm(monkeypatch, broken)
    reason = self_check.self_check_refusal(FlashInferTrtllmExperts, CPU, Activation.RELU2)
    assert reason.startswith("self-check raised RuntimeError: no kernel image")


def test_self_check_can_be_skipped(monkeypatch, skip_self_check):
    kernel = RecordingTrtllmKernel()
    install_trtllm(monkeypatch, kernel)
    assert self_check.self_check_refusal(FlashInferTrtllmExperts, CPU, Activation.SILU) is None
    assert kernel.calls == []


def test_cutlass_jit_policy(monkeypatch):
    """An unbuilt module: "auto" never builds it; named, it may be built (the self-check runs
    it), unless the variable is 0; with the variable at 1, "auto" may build it too."""
    unbuilt = "FlashInfer's fused_moe_90 module is not built (test)"
    monkeypatch.setattr(FlashInferCutlassExperts, "_module_missing_reason", lambda setup: unbuilt)
    kernel = EmulatedCutlassKernel(Activation.SILU)
    install_cutlass(monkeypatch, kernel)
    setup = selection_setup(Activation.SILU)
    monkeypatch.setenv(flashinfer_cutlass.ALLOW_JIT_ENV, "0")
    assert FlashInferCutlassExperts.unavailable_reason(setup) == unbuilt
    assert kernel.calls == []  # refused before the self-check: nothing was built
    monkeypatch.delenv(flashinfer_cutlass.ALLOW_JIT_ENV)
    assert FlashInferCutlassExperts.auto_refusal(setup) == unbuilt
    assert FlashInferCutlassExperts.unavailable_reason(setup) is None  # named: runs
    assert len(kernel.calls) == len(TopkLayout)
    monkeypatch.setenv(flashinfer_cutlass.ALLOW_JIT_ENV, "1")
    assert FlashInferCutlassExperts.auto_refusal(setup) is None


# --- 4. availability probes --------------------------------------------------------------------


def test_trtllm_cubin_probe(monkeypatch, tmp_path):
    from flashinfer.artifacts import ArtifactPath
    from flashinfer.jit import env as jit_env

    monkeypatch.setattr(jit_env, "FLASHINFER_CUBIN_DIR", tmp_path)
    start = time.monotonic()
    reason = flashinfer_trtllm.trtllm_cubins_missing_reason()
    assert time.monotonic() - start < 1.0
    assert "FLASHINFER_CUBIN_DIR" in reason and "checksums.txt is missing" in reason
    root = tmp_path / ArtifactPath.TRTLLM_GEN_BMM
    (root / "include").mkdir(parents=True)
    (root / "checksums.txt").write_text("aa include/meta.h\nbb Bmm_kernel.cubin\n")
    (root / "include" / "meta.h").write_text("")
    reason = flashinfer_trtllm.trtllm_cubins_missing_reason()
    assert "1 of 2" in reason and "Bmm_kernel.cubin" in reason
    (root / "Bmm_kernel.cubin").write_bytes(b"")
    assert flashinfer_trtllm.trtllm_cubins_missing_reason() is None


def test_cutlass_module_probe(monkeypatch, tmp_path):
    from flashinfer.jit import env as jit_env

    assert flashinfer_cutlass.cutlass_module_name(90, 132) == "fused_moe_90"
    assert flashinfer_cutlass.cutlass_module_name(90, 78) == "fused_moe_90_h20_prebuilt_d"
    assert flashinfer_cutlass.cutlass_module_name(100, 148) == "fused_moe_100"
    assert flashinfer_cutlass.cutlass_module_name(103, 148) == "fused_moe_103"
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path)
    reason = flashinfer_cutlass.cutlass_module_missing_reason("fused_moe_90")
    assert "not built" in reason and flashinfer_cutlass.ALLOW_JIT_ENV in reason
    (tmp_path / "fused_moe_90").mkdir()
    (tmp_path / "fused_moe_90" / "fused_moe_90.so").write_bytes(b"")
    assert flashinfer_cutlass.cutlass_module_missing_reason("fused_moe_90") is None


def test_registered_with_capabilities():
    trtllm, cutlass = EXPERTS["flashinfer_trtllm"], EXPERTS["flashinfer_cutlass"]
    assert trtllm is FlashInferTrtllmExperts and cutlass is FlashInferCutlassExperts
    assert trtllm.capabilities.cuda_archs == {100, 103}
    assert cutlass.capabilities.cuda_archs == {90, 100, 103}
    assert trtllm.auto_priority == 30 and cutlass.auto_priority == 20
    for cls in (trtllm, cutlass):
        assert cls.capabilities.preferred_layout is TopkLayout.STANDARD
        assert cls.capabilities.layouts == set(TopkLayout)
        assert cls.capabilities.dtypes == {torch.bfloat16}


def test_refused_on_cpu_at_once_without_importing_flashinfer():
    code = (
        "import sys, time, torch\n"
        "from ep_runtime.experts import EXPERTS\n"
        "from ep_runtime.experts.self_check import check_setup\n"
        "from ep_runtime.types import Activation\n"
        "setup = check_setup(Activation.SILU, torch.device('cpu'))\n"
        "start = time.monotonic()\n"
        "for name in ('flashinfer_trtllm', 'flashinfer_cutlass'):\n"
        "    print(EXPERTS[name].refusal(setup, None))\n"
        "assert time.monotonic() - start < 1.0\n"
        "assert 'flashinfer' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["runs on ['cuda'], not cpu"] * 2
