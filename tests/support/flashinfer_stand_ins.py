"""Stand-ins for FlashInfer's MoE kernels, used only to test our adapters' logic (the arguments
they pass, the self-check's verdicts); never a substitute for the real-kernel tests
(tests/multigpu/test_flashinfer_real.py). Shared by tests/test_flashinfer_*.py."""

from __future__ import annotations

import torch

from ep_runtime.experts import flashinfer_cutlass, flashinfer_trtllm
from ep_runtime.types import Activation, Dispatched


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


def install_trtllm(monkeypatch, kernel) -> None:
    monkeypatch.setattr(flashinfer_trtllm, "trtllm_kernel", lambda name: kernel)


def install_cutlass(monkeypatch, kernel) -> None:
    monkeypatch.setattr(
        flashinfer_cutlass, "cutlass_kernels", lambda: (kernel, kernel.workspace_size)
    )


def random_weights(activation: Activation, num_local: int, hidden: int, intermediate: int):
    rows = 2 * intermediate if activation.is_gated else intermediate
    w13 = torch.randn(num_local, rows, hidden).to(torch.bfloat16)
    w2 = torch.randn(num_local, hidden, intermediate).to(torch.bfloat16)
    return w13, w2


def assert_routing_arguments(ids: torch.Tensor, weights: torch.Tensor, dispatched: Dispatched):
    expected_ids = dispatched.topk_ids
    assert ids.dtype == torch.int32 and ids.is_contiguous()
    assert torch.equal(ids.to(torch.int64), expected_ids)
    assert weights.dtype == torch.float32 and weights.is_contiguous()
    used = expected_ids >= 0
    assert torch.equal(weights[used], dispatched.topk_weights[used])
    assert not weights[~used].any()  # exact zeros, NaN gone
    assert (~used).any() and torch.isnan(dispatched.topk_weights[~used]).all()
