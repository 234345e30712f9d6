"""A transformers model's FP8 routed experts (``FP8Experts``, FineGrainedFP8: e4m3 weights and
fp32 scales per 128×128 block), run unpatched: whether transformers' own forward runs here (it
needs CUDA kernels: DeepGEMM or the ``kernels`` hub's finegrained-fp8 Triton kernel), and, where
it does not, the fp8 contract's math as their forward, so that the unpatched model still has a
reference to compare with (the launcher's validation). Nothing here imports ``transformers``."""

from __future__ import annotations

import types

import torch
from torch import nn

from ep_runtime.quantization import FP8_DTYPE, dequantize_weight_blocks, fake_quantize_activations
from ep_runtime.reference import reference_moe

# what a missing kernel raises; with transformers 5.25 and its `kernels` 0.19 dependency, a hub
# kernel that cannot be fetched (offline) fails its publisher check with a ValueError
KERNEL_ERRORS = (ImportError, NotImplementedError, RuntimeError, ValueError)


def fp8_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding e4m3 ``gate_up_proj`` weights (transformers' ``FP8Experts``)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if getattr(getattr(module, "gate_up_proj", None), "dtype", None) == FP8_DTYPE
    ]


def fp8_forward_unavailable(model: nn.Module) -> str | None:
    """Why transformers' own forward of ``model``'s FP8 experts cannot run here (one line), or
    None when it ran (one token through the first FP8 experts module)."""
    found = fp8_experts(model)
    if not found:
        return None
    _, experts = found[0]
    embeddings = model.get_input_embeddings().weight
    token = torch.zeros(1, experts.gate_up_proj.size(2), dtype=embeddings.dtype)
    one = torch.ones(1, 1, dtype=torch.float32, device=embeddings.device)
    try:
        with torch.no_grad():
            experts(token.to(embeddings.device), one.long() * 0, one)
    except KERNEL_ERRORS as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def _contract_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    """``FP8Experts.forward`` as the contract computes it: ``reference_moe`` in fp64 on the
    dequantized weights, each GEMM's input quantized per token and 128 columns."""
    w13 = dequantize_weight_blocks(self.gate_up_proj, self.gate_up_proj_scale_inv)
    w2 = dequantize_weight_blocks(self.down_proj, self.down_proj_scale_inv)
    out = reference_moe(
        hidden_states, top_k_index, top_k_weights, w13, w2, gemm_input=fake_quantize_activations
    )
    return out.to(hidden_states.dtype)


def use_contract_experts(model: nn.Module) -> int:
    """Make every FP8 experts module of ``model`` compute the contract's math instead of
    transformers' kernels (weights dequantized per call: a validation tool for small models);
    returns how many modules."""
    found = fp8_experts(model)
    for _, experts in found:
        experts.forward = types.MethodType(_contract_forward, experts)
    return len(found)
