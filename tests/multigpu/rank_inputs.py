"""Inputs of the multi-rank suite: case specs, deterministic weights and inputs (different
per rank), and the layer under test. Everything here runs inside a pool rank with
torch.distributed initialised; weights are global and the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.comm import default_device
from ep_runtime.eplb import zipf_routing
from ep_runtime.forward_graphs import DEFAULT_GRAPH_POLICY
from ep_runtime.quantization import quantize_weight_blocks


@dataclass(frozen=True)
class CaseSpec:
    dispatcher: str = "torch_a2a"
    experts: str = "reference"
    layout: str = "standard"
    activation: str = "silu"
    mode: str = "exact"
    dtype: torch.dtype = torch.bfloat16
    num_experts: int = 8
    top_k: int = 3  # config maximum
    k: int | None = None  # K in force (columns of topk_ids); None = top_k
    hidden: int = 256  # every backend serves it: DeepEP V2 needs H % 256, TRTLLM H % 128
    intermediate: int = 64
    tokens: tuple[int, ...] | None = None  # per rank; None = odd, uneven defaults
    cap: int = 16
    routing: str = "random"  # random | one_expert | all_unused
    seed: int = 0
    poison: bool = False
    idle_k: int | None = None  # K of the ids a rank with no tokens passes; None = k
    quantization: str | None = None  # "fp8_block": e4m3 weights, rows dispatched as q(x)
    forward_graphs: bool = True  # the layer's CUDA graphs of its eager forwards (the default)

    def config(self) -> MoEConfig:
        return MoEConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            activation=self.activation,
            dtype=self.dtype,
            max_tokens_per_rank=self.cap,
            quantization=self.quantization,
        )

    def tokens_for(self, rank: int) -> int:
        if self.tokens is not None:
            return self.tokens[rank]
        return min(self.cap, 5 + 4 * rank) if self.mode == "capacity" else 5 + 4 * rank


# Edge cases every dispatcher's suite runs (world size 2), as CaseSpec overrides.
EDGE_CASES: dict[str, dict] = {
    "no_tokens_on_rank0": dict(tokens=(0, 9)),
    "no_tokens_anywhere": dict(tokens=(0, 0)),
    "one_token": dict(tokens=(1, 1)),
    "odd_tokens": dict(tokens=(7, 3)),
    "all_to_one_expert": dict(routing="one_expert"),
    "all_slots_unused": dict(routing="all_unused"),
    "k_equals_1": dict(top_k=1),
    "k_below_config_top_k": dict(top_k=4, k=2),
    "experts_equal_world": dict(num_experts=2, top_k=2),
    "full_cap_not_power_of_two": dict(cap=6, tokens=(6, 5)),
}


# exact mode only: an idle rank passes [0, top_k] ids while the others use K = 2
IDLE_RANK_OTHER_K = dict(tokens=(0, 7), top_k=4, k=2, idle_k=4)


CHUNKED_PAST_CAP = dict(cap=4, tokens=(11, 2))  # exact mode: rank 0 needs 3 chunks, rank 1 one


def device() -> torch.device:
    return default_device(dist.group.WORLD)


def make_weights(spec: CaseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``w13 [E, 2I|I, H]``, ``w2 [E, H, I]`` in the compute dtype, same on all ranks."""
    generator = torch.Generator().manual_seed(1000 + spec.seed)
    cfg = spec.config()
    w13 = torch.randn(spec.num_experts, cfg.w13_rows, spec.hidden, generator=generator)
    w2 = torch.randn(spec.num_experts, spec.hidden, spec.intermediate, generator=generator)
    w13 = w13 / spec.hidden**0.5
    w2 = w2 / spec.intermediate**0.5
    return w13.to(spec.dtype), w2.to(spec.dtype)


def make_inputs(spec: CaseSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]``, ``ids [T, K]`` (distinct per row, some -1, a fully unused row; int64 on even
    ranks, int32 on odd ones, so every multi-rank case takes both widths), ``weights [T, K]``
    distinct, unnormalised, NaN on -1 slots (they must be ignored)."""
    generator = torch.Generator().manual_seed(spec.seed * 7919 + rank)
    num_tokens = spec.tokens_for(rank)
    k = spec.k or spec.top_k
    if num_tokens == 0 and spec.idle_k is not None:
        k = spec.idle_k
    x = torch.randn(num_tokens, spec.hidden, generator=generator).to(spec.dtype)
    scores = torch.rand(num_tokens, spec.num_experts, generator=generator)
    ids = scores.topk(k, dim=1).indices
    if spec.routing == "one_expert":
        ids[:, 0] = spec.num_experts - 1
        ids[:, 1:] = -1
    elif spec.routing == "all_unused":
        ids[:] = -1
    elif num_tokens > 0:
        unused = torch.rand(num_tokens, k, generator=generator) < 0.15
        ids = torch.where(unused, torch.full_like(ids, -1), ids)
        ids[num_tokens // 2] = -1  # one token served by nobody: exact zero row
    weights = 0.25 + 1.5 * torch.rand(num_tokens, k, generator=generator)
    weights = torch.where(ids >= 0, weights, torch.full_like(weights, float("nan")))
    return x, ids.to(torch.int32 if rank % 2 else torch.int64), weights


def build_layer(
    spec: CaseSpec,
    redundant: int = 0,
    eplb_interval: int | None = None,
    given: torch.dtype | None = None,
) -> EPMoE:
    """The case's layer with its weights loaded. ``redundant``, ``eplb_interval``: EPLB's
    options. ``given``: the dtype unquantized weights are handed over in (another than the
    compute dtype: the layer's slot weights are its own copies, which a placement change writes
    in place; the compute dtype: they share the caller's storage)."""
    layer = EPMoE(
        spec.config(),
        dispatcher=spec.dispatcher,
        experts=spec.experts,
        layout=spec.layout,
        mode=spec.mode,
        max_tokens_per_rank=spec.cap,
        device=device(),
        poison=spec.poison,
        forward_graphs=DEFAULT_GRAPH_POLICY if spec.forward_graphs else None,
        num_redundant_experts=redundant,
        eplb_interval=eplb_interval,
    )
    w13, w2 = make_weights(spec)
    if spec.quantization is None:
        layer.load_weights(w13.to(given or spec.dtype), w2.to(given or spec.dtype))
    else:
        (q13, s13), (q2, s2) = quantize_weight_blocks(w13), quantize_weight_blocks(w2)
        layer.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
    return layer


def with_spec(spec: CaseSpec, **changes) -> CaseSpec:
    return replace(spec, **changes)


def skewed_inputs(spec: CaseSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_inputs`` (uneven T, -1 slots, an unserved token, NaN weights on -1 slots, int32 /
    int64 ids by rank) with Zipf(1.2) experts in the used slots, so a rebalance moves experts."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(with_spec(spec, seed=seed), rank)
    skewed, _ = zipf_routing(
        ids.size(0), spec.num_experts, ids.size(1), 1.2, seed=spec.seed + seed, rank=rank
    )
    return x, torch.where(ids >= 0, skewed.to(ids.dtype), ids), weights


def dyadic_inputs(spec: CaseSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small-integer x (|x| ≤ 15) and weights in {1/8 … 4/8}: every partial sum of ≤ 4 slots is
    exact in bf16 (≤ 8 significant bits), so the round trip must be bitwise."""
    x, ids, _ = make_inputs(spec, rank)
    generator = torch.Generator().manual_seed(spec.seed * 104729 + rank)
    x = torch.randint(-15, 16, x.shape, generator=generator).to(spec.dtype)
    eighths = torch.randint(1, 5, ids.shape, generator=generator).float() / 8
    weights = torch.where(ids >= 0, eighths, torch.full_like(eighths, float("nan")))
    return x, ids, weights


def dispatch_only(layer: EPMoE, x, ids, weights):
    """The layer's dispatcher alone (what the experts would get)."""
    dispatched, _ = layer.dispatcher.dispatch(x, ids, weights, layer.layout, layer=layer.identity)
    return dispatched
