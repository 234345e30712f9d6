"""Which backends may be refused on this machine, and with what reason. A refusal is skipped only
when the machine's facts predict it and the backend's own message says so (a regex below); any
other refusal fails the test, so a broken probe that refuses everything turns CI red."""

from __future__ import annotations

import importlib.util

import torch

from ep_runtime.experts.triton import interpreting

CUDA_ONLY = (
    "deepep_v2",
    "deepgemm",
    "flashinfer_trtllm",
    "flashinfer_trtllm_fp8",
    "flashinfer_cutlass",
    "scaled_mm",
    "torch_symm_mem",
)
# Triton's interpreter (CPU) runs every rank's kernels in numpy: slow, and a world of 4 takes no
# kernel path a world of 2 does not (the transports run at 4 with the other experts backends), so
# the matrices run the interpreted Triton experts at world sizes up to this
INTERPRETED_MAX_WORLD_SIZE = 2


def _nvshmem_available() -> bool:
    from torch.distributed import _symmetric_memory as symm_mem

    return bool(symm_mem.is_nvshmem_available())


def expected_refusal(
    backend: str, device_type: str, dtype: torch.dtype, world_size: int
) -> str | None:
    """A regex the refusal of ``backend`` must match where it is expected here, else None."""
    if backend in CUDA_ONLY and device_type != "cuda":
        return r"runs on \['cuda'\], not cpu"
    if backend == "triton" and device_type != "cuda":  # gloo ranks on a GPU machine
        return None if interpreting() else r"only under Triton's interpreter"
    if device_type != "cuda":
        return None
    if backend == "torch_symm_mem":
        if world_size < 2:
            return r"needs a group of >= 2 ranks, got \d+"
        return None if _nvshmem_available() else r"NVSHMEM is not available"
    if backend == "deepep_v2":
        if importlib.util.find_spec("deep_ep") is None:
            return r"deep_ep is not installed"
        return r"NCCL" if torch.cuda.nccl.version() < (2, 30, 4) else None
    if backend == "grouped_mm" and dtype != torch.bfloat16:
        return r"bf16 only"
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if backend in ("flashinfer_trtllm", "flashinfer_trtllm_fp8"):
        if arch not in (100, 103):
            return r"needs SM \[100, 103\]"
        return None if has_flashinfer else r"flashinfer is not importable"
    if backend in ("scaled_mm", "deepgemm") and arch != 90:
        return r"needs SM \[90\]"
    if backend == "deepgemm":
        if dtype != torch.bfloat16:
            return r"supports dtypes \['torch.bfloat16'\]"
        return None if importlib.util.find_spec("deep_gemm") else r"deep_gemm is not installed"
    if backend == "flashinfer_cutlass":
        return r"module is not built" if has_flashinfer else r"flashinfer is not importable"
    return None
