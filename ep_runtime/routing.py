"""Routers of the model presets: router logits → ``(topk_ids int32, topk_weights float32)``."""

from __future__ import annotations

import enum

import torch

from ep_runtime.types import EPInputError, enum_argument


class Scoring(str, enum.Enum):
    SOFTMAX = "softmax"  # Qwen3, Mixtral, DeepSeek-V2-Lite
    SIGMOID = "sigmoid"  # DeepSeek-V3, Nemotron-3


class GroupScoring(str, enum.Enum):
    """How group-limited routing ranks the expert groups."""

    TOP2_SUM = "top2_sum"  # the sum of a group's two best scores (DeepSeek-V3)
    MAX = "max"  # a group's best score (DeepSeek-V2's "group_limited_greedy")


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    *,
    scoring: Scoring | str = Scoring.SOFTMAX,
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,  # [E], selection only (DeepSeek-V3)
    num_expert_groups: int | None = None,
    num_topk_groups: int | None = None,
    group_scoring: GroupScoring | str = GroupScoring.TOP2_SUM,
    routed_scaling_factor: float = 1.0,
    logical_to_physical: torch.Tensor | None = None,  # [E] int, applied last; not for EPMoE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select ``top_k`` experts per token; weights from the scores (bias only steers selection).

    softmax → top-k (→ renormalise): Qwen3 renormalises, DeepSeek-V2-Lite does not.
    sigmoid + bias, group-limited top-k, renormalise, × routed_scaling_factor: DeepSeek-V3
    (groups ranked by their two best scores' sum; ``group_scoring="max"``: by their best,
    DeepSeek-V2's softmax group-limited routing).
    ``EPMoE`` takes logical ids and maps them to its replicas itself (docs/eplb.md).

    Parameters
    ----------
    router_logits : torch.Tensor
        ``[T, E]``, any float dtype: the router's logits, one row per token (scored in fp32).
    top_k : int
        Experts per token, in ``[1, E]``.
    scoring : Scoring or str, default ``"softmax"``
        ``"softmax"`` over each row, or ``"sigmoid"`` per logit.
    renormalize : bool, default True
        Divide each token's ``top_k`` weights by their sum.
    correction_bias : torch.Tensor, optional
        ``[E]`` float, added to the scores for the selection only (DeepSeek-V3's
        ``e_score_correction_bias``); the weights are the unbiased scores.
    num_expert_groups : int, optional
        Split the ``E`` experts into this many equal groups (a divisor of ``E``) and select
        only within the best ``num_topk_groups`` of them; None: no groups.
    num_topk_groups : int, optional
        Groups kept per token, in ``[1, num_expert_groups]``, holding at least ``top_k``
        experts; required with ``num_expert_groups``.
    group_scoring : GroupScoring or str, default ``"top2_sum"``
        How the groups are ranked: the sum of a group's two best scores, or its best
        (``"max"``).
    routed_scaling_factor : float, default 1.0
        Multiplies the weights after any renormalisation (DeepSeek-V3: 2.5).
    logical_to_physical : torch.Tensor, optional
        ``[E]`` int: maps each selected logical id to a physical slot, applied last (a
        standalone EPLB map; not for ``EPMoE``, which maps its own).

    Returns
    -------
    topk_ids : torch.Tensor
        ``[T, top_k]`` int32: the selected expert ids per token, highest selection score
        (bias included) first; physical slots where ``logical_to_physical`` was given.
    topk_weights : torch.Tensor
        ``[T, top_k]`` float32: the router weight of each selected expert.

    Raises
    ------
    EPInputError
        A logits tensor that is not 2-D, ``top_k`` outside ``[1, E]``, an unknown ``scoring``
        or ``group_scoring``, a bias or map not of shape ``[E]``, or group settings that do
        not fit ``E`` and ``top_k``.
    """
    if router_logits.dim() != 2:
        raise EPInputError("router_logits", "a 2-D [T, E] tensor", list(router_logits.shape))
    num_experts = router_logits.size(1)
    if not 1 <= top_k <= num_experts:
        raise EPInputError("top_k", f"in [1, {num_experts}]", top_k)
    scoring = enum_argument(Scoring, "scoring", scoring)
    group_scoring = enum_argument(GroupScoring, "group_scoring", group_scoring)
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise EPInputError("correction_bias", f"shape [{num_experts}]", list(correction_bias.shape))
    if logical_to_physical is not None and tuple(logical_to_physical.shape) != (num_experts,):
        raise EPInputError(
            "logical_to_physical", f"shape [{num_experts}]", list(logical_to_physical.shape)
        )
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring is Scoring.SOFTMAX else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_groups is not None:
        choice = _mask_to_top_groups(
            choice, num_expert_groups, num_topk_groups, top_k, group_scoring
        )
    topk_ids = choice.topk(top_k, dim=-1, sorted=True).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:  # (a decode step's router is host-bound: no × 1 kernel)
        topk_weights = topk_weights * routed_scaling_factor
    if logical_to_physical is not None:
        topk_ids = logical_to_physical.to(topk_ids.device)[topk_ids]
    return topk_ids.to(torch.int32), topk_weights.to(torch.float32)


def _mask_to_top_groups(
    choice: torch.Tensor,
    num_groups: int,
    num_topk_groups: int | None,
    top_k: int,
    group_scoring: GroupScoring,
) -> torch.Tensor:
    """Keep experts of the ``num_topk_groups`` groups ranked highest by ``group_scoring``."""
    num_tokens, num_experts = choice.shape
    if num_experts % num_groups != 0:
        raise EPInputError("num_expert_groups", f"a divisor of {num_experts}", num_groups)
    if num_topk_groups is None or not 1 <= num_topk_groups <= num_groups:
        raise EPInputError("num_topk_groups", f"in [1, {num_groups}]", num_topk_groups)
    per_group = num_experts // num_groups
    if num_topk_groups * per_group < top_k:
        raise EPInputError(
            "num_topk_groups", f">= {-(-top_k // per_group)} to hold top_k={top_k}", num_topk_groups
        )
    grouped = choice.view(num_tokens, num_groups, per_group)
    if group_scoring is GroupScoring.MAX:
        group_scores = grouped.max(dim=-1).values  # [T, G]
    else:
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, G]
    kept = group_scores.topk(num_topk_groups, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = (
        group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
    )
    return choice.masked_fill(~expert_mask, float("-inf"))
