"""FlashInfer experts adapters, on CPU: the self-check run when a backend is considered for a
layer (against correct and wrong kernel stand-ins), the CUTLASS JIT policy, the availability
probes and the registration. Weight preparation and call arguments:
tests/experts/test_flashinfer_experts.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

# CI installs flashinfer: a skip there fails the session (tests/conftest.py); a GPU host may lack it
pytest.importorskip("flashinfer", reason="flashinfer is not installed (the `gpu` extra)")


from ep_runtime.experts import EXPERTS, flashinfer_cutlass, flashinfer_trtllm, self_check
from ep_runtime.experts.flashinfer_cutlass import FlashInferCutlassExperts
from ep_runtime.experts.flashinfer_trtllm import FlashInferTrtllmExperts, gemm1_row_order
from ep_runtime.experts.self_check import check_setup
from ep_runtime.reference import reference_moe
from ep_runtime.types import Activation, TopkLayout
from tests.support.flashinfer_stand_ins import (
    RecordingCutlassKernel,
    RecordingTrtllmKernel,
    install_cutlass,
    install_trtllm,
    random_weights,
)

pytestmark = pytest.mark.usefixtures("fresh_self_check_results")

CPU = torch.device("cpu")


# --- 1. the self-check, run when a backend is considered for a layer ----------------------------


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


# --- 2. availability probes --------------------------------------------------------------------


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
