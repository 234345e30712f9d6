"""Grouped-GEMM experts on ``torch._grouped_mm`` (CPU in torch ≥ 2.13, CUDA SM90+).

Rows grouped by expert (EXPANDED, or expanded here from STANDARD) go through two grouped GEMMs,
``h = x·w13ᵀ`` and ``y = act(h)·w2ᵀ``, with the activation and router weight applied together in
fp32 between them. No Python loop over experts, no host sync. ``_grouped_mm`` leaves rows past the
last offset unwritten and computes padding rows inside groups: both are overwritten with zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ep_runtime.expand import plan_expansion, sum_rows_fp32
from ep_runtime.experts.base import (
    EXPERTS,
    Experts,
    ExpertsCapabilities,
    ExpertsSetup,
    cuda_arch,
    local_expert_index,
)
from ep_runtime.types import Activation, Dispatched, TopkLayout

STRIDE_ALIGNMENT_BYTES = 16  # _grouped_mm needs every stride a multiple of 16 bytes


@EXPERTS.register
class GroupedMMExperts(Experts):
    name = "grouped_mm"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        activations=frozenset(Activation),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.EXPANDED,
        description="torch._grouped_mm, no compile step",
    )
    auto_priority = 10

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        arch = cuda_arch(setup.device)
        if arch is not None and arch < 90:
            return f"torch._grouped_mm needs SM90+ on CUDA, this device is SM{arch}"
        if arch is not None and setup.dtype != torch.bfloat16:
            return f"torch._grouped_mm on CUDA runs bf16 only, not {setup.dtype}"
        element = setup.dtype.itemsize
        for name, size in (
            ("hidden_size", setup.config.hidden_size),
            ("intermediate_size", setup.config.intermediate_size),
        ):
            if (size * element) % STRIDE_ALIGNMENT_BYTES:
                multiple = STRIDE_ALIGNMENT_BYTES // element
                return f"{name}={size} is not a multiple of {multiple} (16-byte strides)"
        return None

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        # _grouped_mm multiplies [N, K] by [G, K, N']: keep transposed views of the weights.
        self.w13_t = w13.transpose(1, 2)  # [L, H, 2I | I]
        self.w2_t = w2.transpose(1, 2)  # [L, I, H]

    def forward(self, dispatched: Dispatched, out: torch.Tensor | None = None) -> torch.Tensor:
        if dispatched.layout is TopkLayout.EXPANDED:
            result = self._grouped(
                dispatched.hidden_states,
                dispatched.topk_weights[:, 0],
                dispatched.topk_ids[:, 0] >= 0,
                dispatched.expert_offsets,
            )
        else:
            result = self._standard(dispatched)
        if out is None:
            return result
        out.copy_(result)
        return out

    def _standard(self, dispatched: Dispatched) -> torch.Tensor:
        """Group the STANDARD rows by expert, run the grouped path, sum slots back in fp32."""
        hidden = dispatched.hidden_states  # [R, H]
        local = local_expert_index(dispatched.topk_ids, self.placement)  # [R, K]
        num_rows, top_k = local.shape
        num_local = self.placement.num_local_experts
        plan = plan_expansion(local, num_local, num_rows * min(top_k, num_local))
        weights = dispatched.topk_weights[plan.source_row, plan.source_slot]
        grouped = self._grouped(
            hidden.index_select(0, plan.source_row), weights, plan.valid, plan.expert_offsets
        )
        return sum_rows_fp32(grouped, plan.slot_position).to(hidden.dtype)

    def _grouped(
        self,
        rows: torch.Tensor,  # [N, H] grouped by local expert
        weights: torch.Tensor,  # [N] router weight per row
        valid: torch.Tensor,  # [N] bool; False rows (padding) may hold NaN
        offsets: torch.Tensor,  # [L + 1] int32 group starts
    ) -> torch.Tensor:
        num_rows, hidden = rows.shape
        if num_rows == 0:
            return rows.new_zeros(0, hidden)
        ends = offsets[1:].to(torch.int32)
        h = torch._grouped_mm(rows, self.w13_t, offs=ends)  # [N, 2I | I]
        h = h.float()
        if self.activation is Activation.SILU:
            half = h.size(1) // 2
            h = F.silu(h[:, :half]) * h[:, half:]
        else:
            h = torch.relu(h).square()
        weight = torch.where(valid, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
        h = (h * weight.unsqueeze(1)).to(rows.dtype)
        y = torch._grouped_mm(h, self.w2_t, offs=ends)  # [N, H]
        return torch.where(valid.unsqueeze(1), y, torch.zeros_like(y))
