"""The per-token tolerance measures error against the size of the summed terms, so a token whose
expert outputs cancel is judged by how well each term was computed, not by its tiny sum."""

from __future__ import annotations

import torch

from ep_runtime import EPMoE, MoEConfig, reference_moe
from ep_runtime.tolerance import compare_per_token, tolerance_for

HIDDEN, INTERMEDIATE = 32, 16


def cancelling_problem():
    """Expert 1 is expert 0 with w2 negated; token 0 routes to both with weights 1 and
    1 - 2⁻¹⁴: its sum is 2⁻¹⁴ of either term. Token 1 routes to expert 2 alone."""
    g = torch.Generator().manual_seed(7)
    w13 = torch.randn(4, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(4, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5
    w13[1], w2[1] = w13[0], -w2[0]
    x = torch.randn(2, HIDDEN, generator=g)
    ids = torch.tensor([[0, 1], [2, -1]])
    weights = torch.tensor([[1.0, 1.0 - 2.0**-14], [0.75, float("nan")]])
    return x, ids, weights, w13, w2


def test_cancellation_is_judged_by_the_terms_not_the_sum() -> None:
    x, ids, weights, w13, w2 = cancelling_problem()
    config = MoEConfig(4, 2, HIDDEN, INTERMEDIATE, dtype=torch.float32)
    layer = EPMoE(config, experts="grouped_mm", device="cpu")
    layer.load_weights(w13, w2)
    out = layer(x, ids, weights)
    ref, scale = reference_moe(x, ids, weights, w13, w2, return_scale=True)
    tolerance = tolerance_for(torch.float32, HIDDEN)
    assert ref[0].norm() < scale[0] / 1000  # the terms cancel by over a thousandfold
    assert compare_per_token(out, ref, tolerance, scale).passed
    assert not compare_per_token(out, ref, tolerance).passed  # relative to the sum: too strict


def test_a_wrong_result_still_fails_against_the_terms() -> None:
    """Dropping one of the two cancelling terms, or scaling the lone term, fails."""
    x, ids, weights, w13, w2 = cancelling_problem()
    ref, scale = reference_moe(x, ids, weights, w13, w2, return_scale=True)
    tolerance = tolerance_for(torch.float32, HIDDEN)
    dropped = reference_moe(x, torch.tensor([[0, -1], [2, -1]]), weights, w13, w2)
    assert not compare_per_token(dropped, ref, tolerance, scale).passed
    scaled = ref.clone()
    scaled[1] *= 1.01
    assert not compare_per_token(scaled, ref, tolerance, scale).passed


def test_scale_is_the_sum_of_term_norms() -> None:
    x, ids, weights, w13, w2 = cancelling_problem()
    _, scale = reference_moe(x, ids, weights, w13, w2, return_scale=True)
    term0 = reference_moe(x[:1], ids[:1, :1], weights[:1, :1], w13, w2).norm()
    term1 = reference_moe(x[:1], ids[:1, 1:], weights[:1, 1:], w13, w2).norm()
    torch.testing.assert_close(scale[0], (term0 + term1).double(), rtol=1e-6, atol=0)
