"""The slow, obviously-right experts: a loop over local experts in fp32, any device.

With fp8 block-scaled weights (``quantization="fp8_block"``) it is the plain-torch twin of the
fp8 kernels, exactly the contract of ep_runtime/quantization.py: GEMM1 consumes ``q(x)``, GEMM2
``q(act(GEMM1))``, both dequantized (``q.float()·s``) against dequantized weights, accumulation
and the activation in fp32, the router weight applied to GEMM2's fp32 output. Rows that arrive
already quantized (fp8 dispatch: e4m3 ``hidden_states`` with ``hidden_states_scale``) are the
same ``q(x)``, dequantized as they are, so the result equals quantizing the bf16 rows here.
"""

from __future__ import annotations

import torch

from ep_runtime.experts.base import EXPERTS, Experts, ExpertsCapabilities
from ep_runtime.quantization import (
    Fp8BlockWeights,
    Quantization,
    dequantize_activations,
    dequantize_weight_blocks,
    quantize_activations,
)
from ep_runtime.reference import activate, expert_ffn
from ep_runtime.types import Activation, Dispatched, TopkLayout


def fp8_block_expert_ffn(
    x: torch.Tensor,  # [N, H] compute dtype, or e4m3 q(x) when x_scale is given
    w13: torch.Tensor,  # [2I | I, H] e4m3
    w13_scale_inv: torch.Tensor,  # [2I/128 | I/128, H/128] fp32
    w2: torch.Tensor,  # [H, I] e4m3
    w2_scale_inv: torch.Tensor,  # [H/128, I/128] fp32
    activation: str,
    x_scale: torch.Tensor | None = None,  # [N, H/128] fp32: x is already q(x)
) -> torch.Tensor:
    """``[N, H]`` fp32: ``w2 · q(act(w13 · q(x)))`` for one expert, the fp8 contract."""
    quantized = quantize_activations(x) if x_scale is None else (x, x_scale)
    x_q = dequantize_activations(*quantized)
    h = x_q @ dequantize_weight_blocks(w13, w13_scale_inv).T  # [N, 2I | I] fp32
    a_q = dequantize_activations(*quantize_activations(activate(h, activation)))
    return a_q @ dequantize_weight_blocks(w2, w2_scale_inv).T


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
        quantizations=frozenset({None, Quantization.FP8_BLOCK}),
        serves_given_weights=True,
        description="torch loop over local experts, fp32 (fp8 block scales: dequantized)",
    )
    auto_priority = 0

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13 = w13  # [L, 2I | I, H]
        self.w2 = w2  # [L, H, I]
        self.fp8: Fp8BlockWeights | None = None

    def load_quantized_weights(self, weights: Fp8BlockWeights) -> None:
        self.fp8 = weights  # kept in e4m3: dequantized one expert at a time

    def expert_output(
        self, expert: int, rows: torch.Tensor, scales: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[N, H]`` fp32 FFN output of local ``expert`` for ``rows [N, H]`` (e4m3 with their
        ``scales [N, H/128]`` when dispatched quantized)."""
        if self.fp8 is not None:
            w = self.fp8
            return fp8_block_expert_ffn(
                rows,
                w.w13[expert],
                w.w13_scale_inv[expert],
                w.w2[expert],
                w.w2_scale_inv[expert],
                self.activation.value,
                x_scale=scales,
            )
        return expert_ffn(
            rows.float(), self.w13[expert].float(), self.w2[expert].float(), self.activation.value
        )

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        hidden = dispatched.hidden_states  # [R, H]
        scale = dispatched.hidden_states_scale  # [R, H/128] or None
        num_rows, top_k = dispatched.topk_ids.shape
        local = self.placement.local.index(dispatched.topk_ids)  # [R, K'] in [0, L]
        per_slot = torch.zeros(
            num_rows, top_k, hidden.size(1), dtype=torch.float32, device=hidden.device
        )
        for expert in range(self.placement.num_local_experts):
            rows, slots = (local == expert).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            weights = dispatched.topk_weights[rows, slots].float().unsqueeze(1)
            scales = None if scale is None else scale[rows]
            per_slot[rows, slots] = weights * self.expert_output(expert, hidden[rows], scales)
        return per_slot.sum(1).to(self.setup.dtype)
