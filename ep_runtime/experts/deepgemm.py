"""fp8 block-scaled experts on DeepGEMM: one m-grouped GEMM over all local experts per layer half,
1×128 activation scales and 128×128 weight scales (the checkpoint's own), on Hopper.

DeepGEMM (``deep_gemm``, DeepSeek's fp8 GEMM library, JIT-compiled per shape) takes all experts'
rows as one contiguous matrix in 128-row aligned blocks, with each expert's end row read on the
device (its "psum" layout), and applies the block scales inside its k loop. So a forward reads
nothing on the host (it may be captured in a CUDA graph) and issues two GEMMs however many experts
there are, where ``scaled_mm`` reads the row counts on the host, then issues a cuBLAS call per
expert and GEMM.

A forward (row kernels in ``experts/gemm/block_rows.py``, layout ``DEEPGEMM``; the order in
``experts/block_grouping.py``): ``q(x)`` as dispatched or quantized here; STANDARD's pairs sorted
by expert; the rows copied into their expert's block, scales as one ``[P, H/128]`` matrix with
the row index fastest; GEMM1 over all blocks; the activation, the contract's quantizer and the
router weight (folded into GEMM2's row scales) in one pass; GEMM2 over all blocks; each row's
slots added in slot order (``kernels/sum_rows.py``).

One difference from the contract, declared in ``capabilities.gemm1_output_dtype``: DeepGEMM
writes its output in bf16 only, so GEMM1's fp32 sums are rounded to bf16 before the activation
(as DeepSeek-V3's own inference code and the field's DeepGEMM MoE paths do; the activation runs
in fp32 on the rounded values), and the compute dtype must be bf16. Tests judge it against the
fp64 oracle of that variant; its distance to the contract is in BENCHMARKS.md.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from pathlib import Path
from typing import ClassVar

import torch

from ep_runtime.experts.base import (
    EXPERTS,
    Experts,
    ExpertsCapabilities,
    ExpertsSetup,
    WorkBuffers,
)
from ep_runtime.experts.block_grouping import BlockGrouping
from ep_runtime.experts.gemm.block_rows import DEEPGEMM
from ep_runtime.kernels.sum_rows import triton_sum_rows
from ep_runtime.kernels.triton_common import HAS_TRITON
from ep_runtime.quantization import BLOCK, FP8_DTYPE, Fp8BlockWeights, Quantization
from ep_runtime.types import Activation, Dispatched, TopkLayout

BF16 = torch.bfloat16


def _nvcc() -> str | None:
    """The nvcc DeepGEMM's JIT will run, looked for where it looks: ``$CUDA_HOME``,
    ``$CUDA_PATH``, ``PATH``, ``/usr/local/cuda``."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            return str(Path(home, "bin", "nvcc")) if Path(home, "bin", "nvcc").is_file() else None
    found = shutil.which("nvcc")
    if found is not None:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


@functools.cache
def _deep_gemm_problem() -> str | None:
    """Why an installed ``deep_gemm`` cannot run here (it does not import, or its JIT has no
    nvcc), checked once per process, so ``"auto"`` falls back instead of failing later."""
    try:
        import deep_gemm
    except Exception as error:  # an ABI mismatch or a missing library: any import failure
        return f"deep_gemm does not import: {type(error).__name__}: {error}"
    if not hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous"):
        return f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has no m-grouped fp8 GEMM"
    if _nvcc() is None:
        return "no nvcc for DeepGEMM's JIT (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"
    return None


@EXPERTS.register
class DeepGemmExperts(Experts):
    name = "deepgemm"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({BF16}),  # DeepGEMM's grouped GEMMs write bf16
        activations=frozenset(Activation),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.STANDARD,
        cuda_archs=frozenset({90}),  # fp32 block scales (SM100's DeepGEMM wants UE8M0)
        quantizations=frozenset({Quantization.FP8_BLOCK}),
        graph_capturable=True,  # the GEMMs read each expert's end row on the device
        gemm1_output_dtype=BF16,  # DeepGEMM writes bf16 only (module docstring)
        description=(
            "DeepGEMM's m-grouped block-scaled fp8 GEMMs (one per layer half; GEMM1's output "
            "in bf16), prefill"
        ),
    )
    auto_priority = 17  # above scaled_mm (16): where both may run, one GEMM beats 32 calls
    # decode-sized layers go to the Triton experts (measured there); DeepGEMM's 128-row blocks
    # are mostly padding when experts get a few rows each
    auto_min_tokens_per_rank: ClassVar[int] = 1024

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        if importlib.util.find_spec("deep_gemm") is None:
            return "deep_gemm is not installed (DeepGEMM, built from source: docs/deepgemm.md)"
        if not HAS_TRITON:
            return "triton is not installed (the row kernels around the GEMMs)"
        return _deep_gemm_problem()

    @classmethod
    def auto_refusal(cls, setup: ExpertsSetup) -> str | None:
        if setup.token_cap < cls.auto_min_tokens_per_rank:
            return (
                f"128-row expert blocks: picked at {cls.auto_min_tokens_per_rank}+ tokens per "
                f"rank (prefill), not a cap of {setup.token_cap}"
            )
        return None

    def __init__(self, setup: ExpertsSetup) -> None:
        super().__init__(setup)
        import deep_gemm

        self._grouped_gemm = deep_gemm.m_grouped_fp8_gemm_nt_contiguous
        self.buffers = WorkBuffers(setup.device)
        self._grouping = BlockGrouping(DEEPGEMM, self.placement, self.buffers, with_ends=True)

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        raise TypeError(f"{self.name} takes fp8 weights (load_quantized_weights)")

    def load_quantized_weights(self, weights: Fp8BlockWeights) -> None:
        # as DeepGEMM takes B: e4m3 [L, N, K] and fp32 [L, N/128, K/128], both contiguous
        self.up = (weights.w13.contiguous(), weights.w13_scale_inv.contiguous())
        self.down = (weights.w2.contiguous(), weights.w2_scale_inv.contiguous())
        self.up_rows = weights.w13.size(1)  # 2I | I

    def workspace_bytes(self, max_rows: int) -> int:
        """The blocks of GEMM1's input and bf16 output, ``q(act)``, GEMM2's bf16 output, the
        maps, and the output (rows quantized here when they arrive unquantized)."""
        config = self.config
        hidden, width = config.hidden_size, config.intermediate_size
        per_block_row = 2 * config.w13_rows + width + 4 * width // BLOCK + 2 * hidden
        blocks = self._grouping.workspace_bytes(max_rows, config.top_k, hidden, per_block_row)
        return blocks + max_rows * 2 * hidden

    def release_workspace(self) -> None:
        self.buffers.clear()

    def _gemm(
        self,
        rows: torch.Tensor,  # [bound, K] e4m3
        flat_scales: torch.Tensor,  # [K/128 · S] fp32
        weight: tuple[torch.Tensor, torch.Tensor],  # [L, N, K] e4m3, [L, N/128, K/128] fp32
        ends: torch.Tensor,  # [L] int32 block ends
        out: torch.Tensor,  # [bound, N] bf16
    ) -> None:
        """``out[block e] = rows[block e] · B_eᵀ`` for every expert, block scales applied by
        DeepGEMM; rows past the last block are neither read nor written."""
        bound, groups = rows.size(0), rows.size(1) // BLOCK
        stride = self._grouping.layout.scale_stride(bound)
        scales = flat_scales.as_strided((bound, groups), (1, stride))  # [bound, K/128]
        self._grouped_gemm((rows, scales), weight, out, ends, use_psum_layout=True)

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        num_rows, width = dispatched.hidden_states.size(0), self.config.intermediate_size
        hidden = self.config.hidden_size
        get = self.buffers.get
        out = get("out", num_rows, hidden, BF16)  # [R, H]
        if num_rows == 0:
            return out
        grouped = self._grouping.group(dispatched)
        bound = grouped.bound
        assert grouped.ends is not None
        up_out = get("h", bound, self.up_rows, BF16)  # [bound, 2I | I]
        self._gemm(grouped.rows, grouped.row_scales, self.up, grouped.ends, up_out)
        act = get("act", bound, width, FP8_DTYPE)  # [bound, I]
        scale_floats = width // BLOCK * self._grouping.layout.scale_stride(bound)
        act_scales = get("act_scales", scale_floats, 1, torch.float32).view(-1)
        self._grouping.activate(grouped, up_out, act, act_scales, gated=self.activation.is_gated)
        down_out = get("y", bound, hidden, BF16)  # [bound, H], weighted rows
        self._gemm(act, act_scales, self.down, grouped.ends, down_out)
        return triton_sum_rows(down_out, grouped.positions, out)
