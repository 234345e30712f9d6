"""route(): checked against hand computations of each router."""

from __future__ import annotations

import pytest
import torch

from ep_runtime import EPInputError, route


def test_softmax_topk_renormalised() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    ids, weights = route(logits, 2)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2]]
    e2, e1 = torch.exp(torch.tensor(2.0)), torch.exp(torch.tensor(1.0))
    torch.testing.assert_close(weights, torch.stack([e2, e1]).unsqueeze(0) / (e2 + e1))


def test_softmax_without_renormalisation_keeps_probabilities() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    _, weights = route(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    torch.testing.assert_close(weights, probs[:, [1, 2]])


def test_deepseek_v3_group_limited_sigmoid_with_bias() -> None:
    """4 groups of 2 experts, keep the best 2 groups (by the sum of their top-2 biased scores),
    pick top-2 experts among them; weights are unbiased sigmoid scores, renormalised, × 2.5."""
    logits = torch.tensor([[3.0, -5.0, 0.0, 0.0, 2.5, 2.5, -1.0, 4.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.9])
    ids, weights = route(
        logits,
        2,
        scoring="sigmoid",
        correction_bias=bias,
        num_expert_groups=4,
        num_topk_groups=2,
        routed_scaling_factor=2.5,
    )
    s = logits.sigmoid()[0]
    b = s + bias
    group_scores = [float(b[2 * g] + b[2 * g + 1]) for g in range(4)]
    kept = sorted(range(4), key=lambda g: -group_scores[g])[:2]
    assert sorted(kept) == [1, 2]  # groups {2,3} and {4,5}: expert 0's group loses despite s[0]
    assert sorted(ids[0].tolist()) == [4, 5]
    expected = torch.stack([s[4], s[5]]) / (s[4] + s[5]) * 2.5
    torch.testing.assert_close(weights[0].sort().values, expected.sort().values)


@pytest.mark.parametrize("groups", [None, 4])
def test_no_tokens_route_to_empty_ids_and_weights(groups: int | None) -> None:
    """An idle rank routes zero tokens (T = 0) with every router, group-limited included."""
    ids, weights = route(
        torch.empty(0, 8),
        2,
        scoring="sigmoid",
        correction_bias=torch.zeros(8),
        num_expert_groups=groups,
        num_topk_groups=None if groups is None else 2,
    )
    assert ids.shape == weights.shape == (0, 2)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32


def test_logical_to_physical_map_applied_last() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    mapping = torch.tensor([3, 2, 1, 0])
    ids, _ = route(logits, 2, logical_to_physical=mapping)
    assert ids.tolist() == [[2, 1]]


def test_bad_router_arguments() -> None:
    with pytest.raises(EPInputError, match=r"^top_k"):
        route(torch.zeros(2, 4), 5)
    with pytest.raises(EPInputError, match=r"^router_logits"):
        route(torch.zeros(4), 1)
    with pytest.raises(EPInputError, match=r"^num_expert_groups"):
        route(torch.zeros(2, 6), 2, num_expert_groups=4, num_topk_groups=1)


def test_groups_ranked_by_their_best_score() -> None:
    """DeepSeek-V2's ranking: 4 groups of 2, the best 2 groups by their single best softmax
    score ({0, 1} and {4, 5}; by their top-2 sum {2, 3} would beat {4, 5}), top-2 experts among
    them, weights the plain probabilities."""
    logits = torch.tensor([[3.0, -5.0, 2.6, 2.5, 2.7, -5.0, 0.0, 0.0]])
    ids, weights = route(
        logits, 2, renormalize=False, num_expert_groups=4, num_topk_groups=2, group_scoring="max"
    )
    p = logits.softmax(-1)[0]
    assert sorted(ids[0].tolist()) == [0, 4]
    torch.testing.assert_close(weights[0].sort().values, torch.stack([p[4], p[0]]).sort().values)
    top2_sum, _ = route(logits, 2, renormalize=False, num_expert_groups=4, num_topk_groups=2)
    assert sorted(top2_sum[0].tolist()) == [0, 2]  # groups {0,1} and {2,3} by the sum


def test_router_options_are_validated() -> None:
    with pytest.raises(EPInputError, match=r"^scoring: expected one of"):
        route(torch.zeros(2, 4), 1, scoring="softmx")
    with pytest.raises(EPInputError, match=r"^group_scoring: expected one of"):
        route(torch.zeros(2, 4), 1, group_scoring="sum")
    with pytest.raises(EPInputError, match=r"^correction_bias: expected shape \[4\]"):
        route(torch.zeros(2, 4), 1, scoring="sigmoid", correction_bias=torch.zeros(1))
    with pytest.raises(EPInputError, match=r"^logical_to_physical: expected shape \[4\]"):
        route(torch.zeros(2, 4), 1, logical_to_physical=torch.arange(3))
