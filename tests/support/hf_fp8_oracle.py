"""The oracle of the FP8 transformers tests: an unpatched model whose FP8 experts are computed by
the tests' own fp64 oracle of the contract (tests/support/fp8_oracle.py), routed by the HF block's
own
router; nothing here imports ep_runtime. Where transformers' own fp8 forward runs (CUDA kernels),
the tests also compare with it."""

from __future__ import annotations

import types

import torch
from torch import nn

from tests.support import fp8_oracle


def fp8_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name → module for the modules with e4m3 ``gate_up_proj`` (transformers' ``FP8Experts``)."""
    return {
        name: module
        for name, module in model.named_modules()
        if getattr(getattr(module, "gate_up_proj", None), "dtype", None) == torch.float8_e4m3fn
    }


def oracle_experts_output(
    experts: nn.Module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H] fp64, scale [T])``: the contract on ``experts``' own e4m3 tensors."""
    return fp8_oracle.fp8_moe_oracle(
        x,
        ids,
        weights,
        experts.gate_up_proj,
        experts.gate_up_proj_scale_inv,
        experts.down_proj,
        experts.down_proj_scale_inv,
        "silu",
    )


def block_oracle(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpatched DeepSeek-V3 MoE block on ``x [T, H]``: its own router (``gate``), the fp64
    contract for the routed experts, its shared experts; ``(out [T, H] fp64, scale [T])``."""
    _, topk_weights, topk_ids = block.gate(x)
    routed, scale = oracle_experts_output(block.experts, x, topk_ids, topk_weights)
    shared = block.shared_experts(x).double()
    return routed + shared, scale + shared.norm(dim=1)


def _oracle_forward(self, hidden_states, top_k_index, top_k_weights):
    out, _ = oracle_experts_output(self, hidden_states, top_k_index, top_k_weights)
    return out.to(hidden_states.dtype)


def use_oracle_experts(model: nn.Module) -> int:
    """Every FP8 experts module of ``model`` computes the fp64 contract instead of transformers'
    kernels; returns how many."""
    modules = fp8_experts_modules(model)
    for experts in modules.values():
        experts.forward = types.MethodType(_oracle_forward, experts)
    return len(modules)


def transformers_fp8_unavailable(model: nn.Module) -> str | None:
    """Why transformers' own FP8 experts forward cannot run here, or None (one token through
    the first FP8 experts module)."""
    experts = next(iter(fp8_experts_modules(model).values()))
    device = experts.gate_up_proj.device
    dtype = model.get_input_embeddings().weight.dtype
    token = torch.zeros(1, experts.gate_up_proj.size(2), dtype=dtype, device=device)
    try:
        with torch.no_grad():
            experts(
                token,
                torch.zeros(1, 1, dtype=torch.long, device=device),
                torch.ones(1, 1, device=device),
            )
    except (ImportError, NotImplementedError, RuntimeError, ValueError) as error:
        # (ValueError: transformers 5.25's `kernels` hub kernel, not fetchable offline)
        why = f"transformers' FP8 experts forward does not run on {device.type}: {error}"
        return why.splitlines()[0]
    return None
