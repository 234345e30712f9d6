"""Skewed synthetic routing for load-balancing runs: expert popularity Zipf(s) over a seeded
permutation of the experts (the same on every rank), each token drawing K distinct experts
with those probabilities (its own seeded stream per rank)."""

from __future__ import annotations

import torch

from ep_runtime.types import EPInputError

ZIPF_PREFIX = "zipf:"


def parse_zipf(routing: str) -> float | None:
    """``"zipf:S"`` → S (> 0); None for any other routing name."""
    if not routing.startswith(ZIPF_PREFIX):
        return None
    try:
        exponent = float(routing[len(ZIPF_PREFIX) :])
    except ValueError:
        exponent = float("nan")
    if not exponent > 0 or exponent == float("inf"):
        raise EPInputError("routing", "zipf:S with a finite exponent S > 0", routing)
    return exponent


def zipf_popularity(num_experts: int, exponent: float, seed: int) -> torch.Tensor:
    """``[E]`` float64 probabilities: the i-th most popular expert (a seeded permutation)
    has weight ``i^-s``."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_experts, generator=generator)
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-exponent)
    popularity = torch.empty(num_experts, dtype=torch.float64)
    popularity[order] = weights / weights.sum()
    return popularity


def zipf_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    exponent: float,
    *,
    seed: int,
    rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids int32 [T, K], topk_weights float32 [T, K])`` on CPU: K distinct experts per
    token drawn without replacement from ``zipf_popularity``; weights random, summing to 1."""
    if not 1 <= top_k <= num_experts:
        raise EPInputError("top_k", f"in [1, {num_experts}]", top_k)
    popularity = zipf_popularity(num_experts, exponent, seed)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
    if num_tokens == 0:
        ids = torch.empty(0, top_k, dtype=torch.int64)
    else:
        ids = torch.multinomial(
            popularity.expand(num_tokens, num_experts),
            top_k,
            replacement=False,
            generator=generator,
        )
    weights = torch.rand(num_tokens, top_k, generator=generator) + 0.5
    return ids.to(torch.int32), (weights / weights.sum(1, keepdim=True)).to(torch.float32)
