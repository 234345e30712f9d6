"""Which backends may be refused on this machine, and why. A refusal not listed here fails the
test instead of skipping it, so a broken probe that refuses everything turns CI red."""

from __future__ import annotations

import importlib.util

import torch

CUDA_ONLY = ("deepep_v2", "flashinfer_trtllm", "flashinfer_cutlass", "torch_symm_mem")


def expected_refusal(backend: str, device_type: str, dtype: torch.dtype) -> str | None:
    """The reason ``backend`` is expected to be unavailable here, or None if it must run."""
    if backend in CUDA_ONLY and device_type != "cuda":
        return f"{backend} needs CUDA; these ranks run on {device_type}"
    if device_type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    if backend == "flashinfer_trtllm" and arch not in (100, 103):
        return f"TRTLLM routed kernels need SM100/103, this GPU is SM{arch}"
    if backend.startswith("flashinfer") and importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    if backend == "flashinfer_cutlass":
        return "cutlass_fused_moe's JIT module is not built on this machine (module is not built)"
    if backend == "deepep_v2":
        return "deep_ep V2 with NCCL >= 2.30.4 may be absent on this machine"
    if backend == "torch_symm_mem":
        return "symmetric memory needs >= 2 GPUs in the group"
    if backend == "grouped_mm" and dtype != torch.bfloat16:
        return "torch._grouped_mm on CUDA runs bf16 only"
    return None
