"""Grouped-GEMM experts on ``torch._grouped_mm`` (CPU in torch ≥ 2.13, CUDA SM90+).

Rows grouped by expert (EXPANDED, or grouped here from STANDARD by the same counting sort the
dispatchers use) go through two grouped GEMMs, ``h = x·w13ᵀ`` and ``y = act(h)·w2ᵀ``, with the
activation and the router weight applied together in one fp32 pass between them. No Python loop
over experts, no host sync. Rows past the last group offset are left unwritten: they are padding,
and nothing reads them.
"""

from __future__ import annotations

import torch

from ep_runtime.experts.base import (
    EXPERTS,
    Experts,
    ExpertsCapabilities,
    ExpertsSetup,
    cuda_arch,
)
from ep_runtime.kernels import resolve_ops
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
        graph_capturable=True,
        serves_given_weights=True,
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

    def __init__(self, setup: ExpertsSetup) -> None:
        super().__init__(setup)
        self.ops = resolve_ops(setup.device)

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        # _grouped_mm multiplies [N, K] by [G, K, N']: keep transposed views of the weights.
        self.w13_t = w13.transpose(1, 2)  # [L, H, 2I | I]
        self.w2_t = w2.transpose(1, 2)  # [L, I, H]

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        if dispatched.layout is TopkLayout.EXPANDED:
            assert dispatched.expert_offsets is not None
            return self.grouped(
                dispatched.hidden_states, dispatched.topk_weights[:, 0], dispatched.expert_offsets
            )
        hidden = dispatched.hidden_states  # [R, H]
        num_rows, top_k = dispatched.topk_ids.shape
        num_local = self.placement.num_local_experts
        grouped = self.ops.group_rows(
            hidden,
            dispatched.topk_ids,
            dispatched.topk_weights,
            local_offset=self.placement.local_expert_offset,
            num_local=num_local,
            num_rows=num_rows * min(top_k, num_local),
        )
        results = self.grouped(grouped.hidden, grouped.weights, grouped.offsets)
        return self.ops.sum_rows(results, grouped.positions)  # [R, H]

    def grouped(
        self,
        rows: torch.Tensor,  # [N, H] grouped by local expert
        weights: torch.Tensor,  # [N] fp32 router weight per row
        offsets: torch.Tensor,  # [L + 1] int32 group starts; rows past offsets[L] are padding
    ) -> torch.Tensor:
        """``[N, H]`` weighted expert outputs; padding rows unwritten."""
        if rows.size(0) == 0:
            return rows.new_zeros(0, rows.size(1))
        ends = offsets[1:]
        h = torch._grouped_mm(rows, self.w13_t, offs=ends)  # [N, 2I | I]
        activated = self.ops.weighted_activation(
            h, weights, gated=self.activation.is_gated
        )  # [N, I]
        return torch._grouped_mm(activated, self.w2_t, offs=ends)  # [N, H]
