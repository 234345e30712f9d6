"""Model presets: the MoE layer shape and router of real models (from their published configs).

Benchmarks use each model's own router, because the router sets how many ranks a token reaches
and so the bytes moved. ``tiny`` is the CPU-friendly default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from ep_runtime.config import MoEConfig
from ep_runtime.routing import Scoring


@dataclass(frozen=True)
class RouterSpec:
    """Arguments of ``route()`` for one model."""

    scoring: str = Scoring.SOFTMAX.value
    renormalize: bool = True
    correction_bias: bool = False  # DeepSeek-V3 / Nemotron-H steer selection with a bias
    num_expert_groups: int | None = None
    num_topk_groups: int | None = None
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class ModelPreset:
    """One MoE layer: ``num_experts`` routed experts of ``hidden → intermediate → hidden``."""

    name: str
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    activation: str
    router: RouterSpec
    tokens_per_rank: int  # default T per rank for this preset

    def with_overrides(self, **overrides: int | str | None) -> ModelPreset:
        """A copy with the given non-None fields replaced (``--hidden`` etc. on the CLI)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def moe_config(self, dtype: torch.dtype | None = None) -> MoEConfig:
        """The layer's shape as the package's ``MoEConfig``, buffers sized for this preset's
        tokens per rank; raises ``EPInputError`` naming a bad field (``hidden_size`` 0, …)."""
        return MoEConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            activation=self.activation,
            dtype=dtype,
            max_tokens_per_rank=max(1, self.tokens_per_rank),
        )

    def to_json(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset("tiny", 128, 16, 4, 256, "silu", RouterSpec(), tokens_per_rank=64),
        ModelPreset(
            "deepseek-v3",
            7168,
            256,
            8,
            2048,
            "silu",
            RouterSpec(
                scoring=Scoring.SIGMOID.value,
                correction_bias=True,
                num_expert_groups=8,
                num_topk_groups=4,
                routed_scaling_factor=2.5,
            ),
            tokens_per_rank=128,
        ),
        ModelPreset(
            "deepseek-v2-lite", 2048, 64, 6, 1408, "silu", RouterSpec(renormalize=False), 256
        ),
        ModelPreset("qwen3-30b-a3b", 2048, 128, 8, 768, "silu", RouterSpec(), 256),
        ModelPreset("mixtral-8x7b", 4096, 8, 2, 14336, "silu", RouterSpec(), 128),
        ModelPreset(
            "nemotron-3-nano",
            2688,
            128,
            6,
            1856,
            "relu2",
            RouterSpec(
                scoring=Scoring.SIGMOID.value, correction_bias=True, routed_scaling_factor=2.5
            ),
            tokens_per_rank=256,
        ),
    )
}


def preset_by_name(name: str) -> ModelPreset:
    """Case- and separator-insensitive lookup: ``DeepSeek-V3``, ``deepseek_v3`` both work."""
    key = name.strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"--model: expected one of {', '.join(PRESETS)}, given {name!r}")
    return PRESETS[key]
