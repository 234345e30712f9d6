"""The slow, obviously-right experts: a loop over local experts in fp32, any device."""

from __future__ import annotations

import torch

from ep_runtime.experts.base import EXPERTS, Experts, ExpertsCapabilities
from ep_runtime.reference import expert_ffn
from ep_runtime.types import Activation, Dispatched, TopkLayout


@EXPERTS.register
class ReferenceExperts(Experts):
    """Per (row, slot) FFN outputs in fp32, summed over slots, rounded once. Syncs the host
    (it looks up which rows each expert has), so it is a correctness baseline, not a fast path."""

    name = "reference"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
        activations=frozenset(Activation),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.STANDARD,
        description="torch loop over local experts, fp32",
    )
    auto_priority = 0

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13 = w13  # [L, 2I | I, H]
        self.w2 = w2  # [L, H, I]

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        hidden = dispatched.hidden_states  # [R, H]
        num_rows, top_k = dispatched.topk_ids.shape
        local = self.placement.local.index(dispatched.topk_ids)  # [R, K'] in [0, L]
        per_slot = torch.zeros(
            num_rows, top_k, hidden.size(1), dtype=torch.float32, device=hidden.device
        )
        for expert in range(self.placement.num_local_experts):
            rows, slots = (local == expert).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = expert_ffn(
                hidden[rows].float(),
                self.w13[expert].float(),
                self.w2[expert].float(),
                self.activation.value,
            )
            weights = dispatched.topk_weights[rows, slots].float().unsqueeze(1)
            per_slot[rows, slots] = weights * y
        return per_slot.sum(1).to(hidden.dtype)
