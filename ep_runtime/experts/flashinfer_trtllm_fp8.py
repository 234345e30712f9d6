"""FlashInfer TRTLLM-gen routed MoE with fp8 block-scaled weights
(``trtllm_fp8_block_scale_routed_moe``, DeepSeek FP8), Blackwell SM100/103 only.

The call is the bf16 adapter's (flashinfer_trtllm.py: ``(ids, weights)`` routing tuple, int32
global ids, ``top_k = topk_ids.size(1)``, ``local_expert_offset = rank·L``), plus:

- activations quantized here by the contract's quantizer (ep_runtime/quantization.py: per token
  and 128 columns): ``hidden_states`` e4m3 ``[R, H]`` and ``hidden_states_scale`` fp32
  ``[H/128, R]`` (the kernel takes the scales transposed);
- ``fp8_quantization_type = DeepSeekFp8``, ``use_shuffled_weight = False``, ``weight_layout =
  MajorK``, ``routing_bias = None``, ``routed_scaling_factor = None`` (weights arrive routed);
- weights as FlashInfer 0.7.2.post1's own ``prepare_trtllm_fp8_block_weights`` lays them out
  for DeepSeek FP8 (a test checks it bitwise): e4m3 ``gemm1 [L, 2I, H]`` in ``[up; gate]``
  order, ``gemm2 [L, H, I]``, fp32 block scales ``[L, 2I/128, H/128]`` (halves swapped the same
  way) and ``[L, H/128, I/128]``. No padding: fp8 blocks already tile H and I.

FlashInfer's block-FP8 runner lists SwiGLU only for DeepSeek FP8, so ``relu2`` is refused; the
output is bf16 (the kernel's only output type). It has never run here (no Blackwell lent); the
self-check against the fp8 twin runs where a layer first considers it.
"""

from __future__ import annotations

import torch

from ep_runtime.experts import flashinfer_trtllm
from ep_runtime.experts.base import EXPERTS, ExpertsCapabilities, ExpertsSetup
from ep_runtime.experts.flashinfer_common import flashinfer_missing_reason
from ep_runtime.experts.flashinfer_trtllm import FlashInferTrtllmExperts, TrtllmWeights
from ep_runtime.experts.self_check import self_check_refusal
from ep_runtime.quantization import Fp8BlockWeights, Quantization, quantize_activations
from ep_runtime.types import Activation, TopkLayout

ROUTING_EXPERT_MULTIPLE = 4  # launcher: "num_experts must be divisible by 4"


def up_gate(weights: torch.Tensor) -> torch.Tensor:
    """``[L, 2M, …]`` ``[gate; up]`` → ``[up; gate]`` (FlashInfer's gated order)."""
    gate, up = weights.chunk(2, dim=1)
    return torch.cat([up, gate], dim=1).contiguous()


@EXPERTS.register
class FlashInferTrtllmFp8Experts(FlashInferTrtllmExperts):
    """fp8 block-scale experts on ``flashinfer.fused_moe.trtllm_fp8_block_scale_routed_moe``."""

    name = "flashinfer_trtllm_fp8"
    capabilities = ExpertsCapabilities(
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        activations=frozenset({Activation.SILU}),
        layouts=frozenset(TopkLayout),
        preferred_layout=TopkLayout.STANDARD,
        cuda_archs=frozenset({100, 103}),  # TRTLLM-gen block-FP8 cubins exist for these only
        quantizations=frozenset({Quantization.FP8_BLOCK}),
        description="FlashInfer TRTLLM-gen routed MoE (fp8 block scales), Blackwell",
    )
    auto_priority = 30
    kernel_name = "trtllm_fp8_block_scale_routed_moe"

    @classmethod
    def unavailable_reason(cls, setup: ExpertsSetup) -> str | None:
        experts = setup.config.num_experts
        if experts % ROUTING_EXPERT_MULTIPLE:
            return (
                f"num_experts={experts} is not a multiple of {ROUTING_EXPERT_MULTIPLE} "
                "(TRTLLM-gen's routing kernel)"
            )
        return (
            flashinfer_missing_reason()
            or flashinfer_trtllm.trtllm_cubins_missing_reason()
            or self_check_refusal(cls, setup.device, Activation.SILU, Quantization.FP8_BLOCK)
        )

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        raise TypeError(f"{self.name} takes fp8 weights (load_quantized_weights)")

    def load_quantized_weights(self, weights: Fp8BlockWeights) -> None:
        from flashinfer.tllm_enums import (
            ActivationType,
            Fp8QuantizationType,
            RoutingMethodType,
            WeightLayout,
        )

        self.weights = self.prepare_fp8_weights(weights)
        self._fixed_args = {
            "activation_type": int(ActivationType.Swiglu),
            "routing_method_type": int(RoutingMethodType.TopK),  # ids precomputed: sort only
            "use_shuffled_weight": False,
            "weight_layout": int(WeightLayout.MajorK),
            "fp8_quantization_type": Fp8QuantizationType.DeepSeekFp8,
            "routing_bias": None,
            "routed_scaling_factor": None,
        }

    def prepare_fp8_weights(self, weights: Fp8BlockWeights) -> TrtllmWeights:
        """Our ``[gate; up]`` fp8 shard → FlashInfer's DeepSeek-FP8 layout (MajorK, unshuffled)."""
        return TrtllmWeights(
            gemm1=up_gate(weights.w13),  # [L, 2I, H] e4m3
            gemm2=weights.w2,  # [L, H, I] e4m3
            intermediate_size=weights.w2.size(2),
            kernel_args={
                "gemm1_weights_scale": up_gate(weights.w13_scale_inv),  # [L, 2I/128, H/128]
                "gemm2_weights_scale": weights.w2_scale_inv,  # [L, H/128, I/128]
            },
        )

    def activation_args(
        self, hidden_states: torch.Tensor, scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if scale is None:
            q, scale = quantize_activations(hidden_states)  # [R, H] e4m3, [R, H/128] fp32
        else:  # fp8 dispatch: the rows arrived as q(x)
            q = hidden_states
        return {"hidden_states": q, "hidden_states_scale": scale.t().contiguous()}
