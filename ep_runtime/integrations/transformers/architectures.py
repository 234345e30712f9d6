"""The supported sparse-MoE block classes and how to read each one's router into ``route()``
arguments. The blocks run the router module itself; these settings describe its routing in
reports, and the tests check that ``route()`` with them reproduces it bit for bit. Matches
blocks by class name and module only: nothing here imports ``transformers``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ep_runtime.routing import GroupScoring, Scoring
from ep_runtime.types import EPInputError


class UnsupportedMoEBlockError(EPInputError):
    """A sparse-MoE block (or a setting of one) this integration cannot reproduce."""


@dataclass(frozen=True)
class RouterSettings:
    """The ``route()`` arguments that reproduce one HF router, read from the router module."""

    top_k: int
    scoring: Scoring
    renormalize: bool
    num_expert_groups: int | None = None
    num_topk_groups: int | None = None
    group_scoring: GroupScoring = GroupScoring.TOP2_SUM
    routed_scaling_factor: float = 1.0
    uses_correction_bias: bool = False  # DeepSeek-V3: gate.e_score_correction_bias
    weights_in_logits_dtype: bool = False  # Qwen3 rounds its top-k weights to the logits' dtype


def _qwen3_router(gate: nn.Module) -> RouterSettings:
    # softmax in fp32 → top-k → optional renormalisation → cast to the logits' dtype
    return RouterSettings(
        top_k=int(gate.top_k),
        scoring=Scoring.SOFTMAX,
        renormalize=bool(gate.norm_topk_prob),
        weights_in_logits_dtype=True,
    )


def _mixtral_router(gate: nn.Module) -> RouterSettings:
    # softmax in fp32 → top-k → always renormalised, weights stay fp32
    return RouterSettings(top_k=int(gate.top_k), scoring=Scoring.SOFTMAX, renormalize=True)


def _deepseek_v3_router(gate: nn.Module) -> RouterSettings:
    # sigmoid; bias steers selection only; group-limited top-k; renormalise; × scaling factor
    return RouterSettings(
        top_k=int(gate.top_k),
        scoring=Scoring.SIGMOID,
        renormalize=bool(gate.norm_topk_prob),
        num_expert_groups=int(gate.num_group),
        num_topk_groups=int(gate.topk_group),
        routed_scaling_factor=float(gate.routed_scaling_factor),
        uses_correction_bias=True,
    )


def _deepseek_v2_router(gate: nn.Module) -> RouterSettings:
    # softmax top-k, never renormalised, × scaling factor: "greedy" (DeepSeek-V2-Lite) or
    # "group_limited_greedy" (DeepSeek-V2: the top groups by their best score first)
    method = gate.topk_method
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedMoEBlockError(
            "DeepseekV2Moe router topk_method", "'greedy' or 'group_limited_greedy'", repr(method)
        )
    grouped = method == "group_limited_greedy"
    return RouterSettings(
        top_k=int(gate.top_k),
        scoring=Scoring.SOFTMAX,
        renormalize=False,
        num_expert_groups=int(gate.num_group) if grouped else None,
        num_topk_groups=int(gate.topk_group) if grouped else None,
        group_scoring=GroupScoring.MAX if grouped else GroupScoring.TOP2_SUM,
        routed_scaling_factor=float(gate.routed_scaling_factor),
    )


@dataclass(frozen=True)
class Architecture:
    """One supported sparse-MoE block class and how to read its router."""

    name: str  # the launcher's name for a random model of this architecture
    module: str  # where transformers defines the block class
    block_class: str
    read_router: Callable[[nn.Module], RouterSettings]

    def matches(self, block: nn.Module) -> bool:
        """Exactly this class (a subclass may route differently)."""
        cls = type(block)
        return cls.__module__ == self.module and cls.__name__ == self.block_class


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "qwen3-moe",
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        _qwen3_router,
    ),
    Architecture(
        "mixtral",
        "transformers.models.mixtral.modeling_mixtral",
        "MixtralSparseMoeBlock",
        _mixtral_router,
    ),
    Architecture(
        "deepseek-v3",
        "transformers.models.deepseek_v3.modeling_deepseek_v3",
        "DeepseekV3MoE",
        _deepseek_v3_router,
    ),
    Architecture(
        "deepseek-v2",
        "transformers.models.deepseek_v2.modeling_deepseek_v2",
        "DeepseekV2Moe",
        _deepseek_v2_router,
    ),
)
SUPPORTED_BLOCKS = ", ".join(arch.block_class for arch in ARCHITECTURES)


def architecture_of(name: str, block: nn.Module) -> Architecture:
    """The supported architecture of ``block`` (found at ``name``), or the error naming it."""
    for arch in ARCHITECTURES:
        if arch.matches(block):
            return arch
    raise UnsupportedMoEBlockError(
        "model", f"sparse-MoE blocks of {SUPPORTED_BLOCKS}", f"{type(block).__name__} at '{name}'"
    )
