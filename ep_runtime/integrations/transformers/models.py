"""Seeded random tiny models per supported architecture (the launcher's and the tests' fixtures),
among them a DeepSeek-V3 with FP8 experts, checkpoint loading, and the model's end-of-sequence
ids. The one part of the integration that needs ``transformers`` itself (the ``hf`` extra)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ep_runtime.integrations.transformers.architectures import ARCHITECTURES
from ep_runtime.quantization import BLOCK, quantize_weight_blocks
from ep_runtime.types import EPInputError

try:  # the optional extra; the rest of the integration works without it
    import transformers
except ImportError:  # pragma: no cover - exercised only where the extra is missing
    transformers = None

TESTED_TRANSFORMERS = "5.24"


def require_transformers() -> Any:
    """The ``transformers`` module, or an ImportError that says how to get it."""
    if transformers is None:
        raise ImportError(
            "ep_runtime.integrations.transformers needs the 'hf' extra: "
            "pip install 'ep_runtime[hf]' (transformers)"
        )
    return transformers


def _tiny_configs() -> dict[str, Callable[[], Any]]:
    """Small random-model configs per architecture (CPU-friendly; 12 experts: W = 1, 2, 3, 4,
    6, 12). Each has a dense layer before or between MoE layers."""
    hf = require_transformers()
    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    deepseek_v3 = dict(
        q_lora_rank=32,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    deepseek = dict(
        common,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=12,
        num_experts_per_tok=3,
    )
    return {
        "qwen3-moe": lambda: hf.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            num_experts=12,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
        "mixtral": lambda: hf.MixtralConfig(
            **common,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_local_experts=12,
            num_experts_per_tok=2,
        ),
        "deepseek-v3": lambda: hf.DeepseekV3Config(**deepseek, **deepseek_v3),
        # routed experts e4m3 with fp32 scales per 128×128 block, as DeepSeek-V3 ships them
        # (H and I one block each, tiny otherwise); see to_fp8_experts
        "deepseek-v3-fp8": lambda: hf.DeepseekV3Config(
            **{**deepseek, "hidden_size": BLOCK, "moe_intermediate_size": BLOCK},
            **deepseek_v3,
            quantization_config=hf.FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK]),
        ),
        "deepseek-v2": lambda: hf.DeepseekV2Config(
            **deepseek,
            q_lora_rank=None,
            topk_method="greedy",
            n_shared_experts=2,
            routed_scaling_factor=1.0,
        ),
    }


RANDOM_MODELS = tuple(arch.name for arch in ARCHITECTURES)  # one per architecture, unquantized
FP8_RANDOM_MODELS = ("deepseek-v3-fp8",)  # FP8 experts (transformers' own fp8 forward needs CUDA)
NAMED_MODELS = (*RANDOM_MODELS, *FP8_RANDOM_MODELS)


def random_config(name: str, **overrides: Any) -> Any:
    """The tiny config of ``name`` (see ``NAMED_MODELS``), fields overridden."""
    configs = _tiny_configs()
    if name not in configs:
        raise EPInputError("model", f"one of {', '.join(configs)}", repr(name))
    config = configs[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_random_model(
    config: Any, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> nn.Module:
    """A causal LM from ``config`` with seeded weights, identical in every process: matrices
    ~ N(0, 1/fan_in) (decisive routers, spread logits), norms ~ 1, DeepSeek-V3's correction
    bias ~ N(0, 0.1²) so that it changes selections. A config with a ``FineGrainedFP8Config``
    gets its routed experts quantized from those weights (``to_fp8_experts``)."""
    hf = require_transformers()
    model = hf.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                values = torch.randn(param.shape, generator=generator) / param.size(-1) ** 0.5
            elif name.endswith("bias"):
                values = 0.1 * torch.randn(param.shape, generator=generator)
            else:
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            param.copy_(values)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    model = model.to(device=device, dtype=dtype).eval()
    quantization = getattr(config, "quantization_config", None)
    return model if quantization is None else to_fp8_experts(model, quantization)


@dataclass(frozen=True)
class RandomExpertSource:
    """``patch_moe_blocks``' ``expert_source`` for a seeded random model: the experts of a block
    of ``build_random_model(config, seed=seed, dtype=dtype)``, which it builds again (on the
    CPU) at each call. Built for the tiny random models, which an elastic recovery re-reads
    in a fraction of a second; FP8 models are not elastic."""

    config: Any
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __call__(
        self, block: str, experts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [n, 2I, H], [n, H, I]
        """Rows ``experts`` of the block's ``gate_up_proj`` and ``down_proj``."""
        model = build_random_model(self.config, seed=self.seed, dtype=self.dtype)
        hf_experts = model.get_submodule(block).experts
        rows = list(experts)
        return hf_experts.gate_up_proj[rows].detach(), hf_experts.down_proj[rows].detach()


def to_fp8_experts(model: nn.Module, quantization: Any) -> nn.Module:
    """``model`` with its routed experts in transformers' FineGrainedFP8 layout: its own
    ``FP8Experts`` modules (``replace_with_fp8_linear``, as ``from_pretrained`` builds them for
    an FP8 checkpoint) holding e4m3 ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` and
    fp32 ``gate_up_proj_scale_inv [E, 2I/128, H/128]`` / ``down_proj_scale_inv [E, H/128,
    I/128]``, quantized per 128×128 block from the current weights. Every other layer keeps its
    dtype (transformers' ``FP8Linear`` needs CUDA kernels; the EP blocks replace only experts);
    ``quantization.modules_to_not_convert`` lists them."""
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    if list(quantization.weight_block_size) != [BLOCK, BLOCK]:
        raise EPInputError(
            "quantization_config.weight_block_size",
            f"[{BLOCK}, {BLOCK}]",
            quantization.weight_block_size,
        )
    quantization.modules_to_not_convert = [
        name for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    originals = {name: m for name, m in model.named_modules() if name.endswith(".experts")}
    replace_with_fp8_linear(
        model,
        modules_to_not_convert=quantization.modules_to_not_convert,
        quantization_config=quantization,
    )
    for name, original in originals.items():
        converted = model.get_submodule(name)  # on the meta device until filled here
        for weight in ("gate_up_proj", "down_proj"):
            q, scale_inv = quantize_weight_blocks(getattr(original, weight).detach())
            setattr(converted, weight, nn.Parameter(q, requires_grad=False))
            setattr(converted, f"{weight}_scale_inv", nn.Parameter(scale_inv, requires_grad=False))
        converted.eval()
    return model


def load_model(
    name_or_path: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> nn.Module:
    """A random tiny model by architecture name, or a local checkpoint directory."""
    hf = require_transformers()
    if name_or_path in NAMED_MODELS:
        return build_random_model(
            random_config(name_or_path), seed=seed, dtype=dtype, device=device
        )
    if Path(name_or_path).is_dir():
        model = hf.AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        return model.to(device).eval()
    raise EPInputError(
        "model", f"one of {', '.join(NAMED_MODELS)} or a local checkpoint directory", name_or_path
    )


def eos_ids(model: nn.Module) -> list[int]:
    """The model's end-of-sequence ids (config, then generation config); may be empty."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    return []
