"""Rank-side code of the multi-rank suite: deterministic inputs, the layer run, oracle checks.

Every function here runs inside a pool rank (``RankPool.run``) with torch.distributed initialised.
Weights are global and identical on every rank (generated from the seed); inputs differ per rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ep_runtime import EPMoE, MoEConfig, reference_moe
from ep_runtime.comm import default_device
from ep_runtime.tolerance import Comparison, compare_per_token, tolerance_for


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
    hidden: int = 128  # TRTLLM needs H % 128 == 0
    intermediate: int = 64
    tokens: tuple[int, ...] | None = None  # per rank; None = odd, uneven defaults
    cap: int = 16
    routing: str = "random"  # random | one_expert | all_unused
    seed: int = 0
    poison: bool = False
    idle_k: int | None = None  # K of the ids a rank with no tokens passes; None = k

    def config(self) -> MoEConfig:
        return MoEConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            activation=self.activation,
            dtype=self.dtype,
            max_tokens_per_rank=self.cap,
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


@dataclass(frozen=True)
class CaseResult:
    rank: int
    comparison: Comparison
    dispatcher: str
    experts: str
    layout: str
    output: torch.Tensor


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


def build_layer(spec: CaseSpec) -> EPMoE:
    layer = EPMoE(
        spec.config(),
        dispatcher=spec.dispatcher,
        experts=spec.experts,
        layout=spec.layout,
        mode=spec.mode,
        max_tokens_per_rank=spec.cap,
        device=device(),
        poison=spec.poison,
    )
    w13, w2 = make_weights(spec)
    layer.load_weights(w13, w2)
    return layer


def run_layer_case(spec: CaseSpec, faults: tuple[str, ...] = ()) -> CaseResult:
    """Run the layer (with optional injected ``faults``) and compare to the oracle on the
    un-faulted inputs, per token."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    w13, w2 = make_weights(spec)
    ref, scale = reference_moe(x, ids, weights, w13, w2, spec.activation, return_scale=True)
    layer = build_layer(spec)
    try:
        layer_x, layer_ids, layer_weights = apply_input_faults(spec, x, ids, weights, faults)
        if "gate_up_swapped" in faults:
            half = spec.intermediate
            layer.load_weights(torch.cat([w13[:, half:], w13[:, :half]], dim=1), w2)
        dev = device()
        out = layer(layer_x.to(dev), layer_ids.to(dev), layer_weights.to(dev))
        if "zero_output" in faults:
            out = torch.zeros_like(out)
        comparison = compare_per_token(
            out, ref, tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate)), scale
        )
        return CaseResult(
            rank,
            comparison,
            layer.choice.dispatcher,
            layer.choice.experts,
            layer.layout.value,
            out.cpu(),
        )
    finally:
        layer.close()


def apply_input_faults(spec: CaseSpec, x, ids, weights, faults: tuple[str, ...]):
    """Negative controls: the layer gets a broken version of the inputs the oracle sees."""
    num_local = spec.num_experts // dist.get_world_size()
    ids = ids.to(torch.int64)
    valid = ids >= 0
    finite_weights = torch.where(valid, weights, torch.zeros_like(weights))
    for fault in faults:
        if fault == "weights_0x":
            weights = torch.where(valid, torch.ones_like(weights), weights)
        elif fault == "weights_2x":
            weights = torch.where(valid, finite_weights.square(), weights)
        elif fault == "dropped_slot":
            first = valid.to(torch.int64).argmax(dim=1, keepdim=True)  # first used slot per row
            ids = ids.scatter(1, first, -1)
        elif fault == "ids_off_by_rank":
            ids = torch.where(valid, (ids + num_local) % spec.num_experts, ids)
        elif fault == "minus_one_is_expert":
            # -1 read as an expert: the smallest expert absent from the row, weight 0.7
            present = torch.zeros(ids.size(0), spec.num_experts + 1, dtype=torch.bool)
            present.scatter_(1, torch.where(valid, ids, spec.num_experts), True)
            stand_in = (~present[:, : spec.num_experts]).to(torch.int64).argmax(dim=1, keepdim=True)
            first_unused = (~valid).to(torch.int64).argmax(dim=1, keepdim=True)
            has_unused = (~valid).any(dim=1, keepdim=True)
            target = torch.zeros_like(valid).scatter_(1, first_unused, True) & has_unused
            ids = torch.where(target, stand_in.expand_as(ids), ids)
            weights = torch.where(target, torch.full_like(weights, 0.7), weights)
    return x, ids, weights


def timed_bad_input(spec: CaseSpec, bad_rank: int, fault: str) -> tuple[str, str, float]:
    """Rank ``bad_rank`` passes bad input; every rank returns (error type, message, seconds)."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    layer = build_layer(spec)
    if rank == bad_rank:
        if fault == "id_out_of_range":
            ids = ids.clone()
            ids[0, 0] = spec.num_experts + 3
        elif fault == "wrong_hidden":
            x = torch.zeros(x.size(0), spec.hidden + 1, dtype=spec.dtype)
        elif fault == "too_many_tokens":
            x, ids, weights = (t.repeat(spec.cap + 1, 1)[: spec.cap + 1] for t in (x, ids, weights))
    dev = device()
    start = time.monotonic()
    try:
        layer(x.to(dev), ids.to(dev), weights.to(dev))
        layer.check()  # capacity mode on CUDA defers errors to here (no host sync in forward)
        return ("none", "", time.monotonic() - start)
    except Exception as error:
        return (type(error).__name__, str(error), time.monotonic() - start)
    finally:
        layer.close()


def with_spec(spec: CaseSpec, **changes) -> CaseSpec:
    return replace(spec, **changes)


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


def weighted_identity(dispatched) -> torch.Tensor:
    """Stand-in experts for round trips: row r → Σ_{served k} w[r,k] · x[r], zero for padding."""
    served = dispatched.topk_ids >= 0
    weight = torch.where(served, dispatched.topk_weights, torch.zeros_like(dispatched.topk_weights))
    rows = torch.where(served.any(1, keepdim=True), dispatched.hidden_states.float(), 0.0)
    return (weight.sum(1, keepdim=True) * rows).to(dispatched.hidden_states.dtype)


def check_round_trip(spec: CaseSpec) -> int:
    """dispatch → weighted identity → combine equals Σ w · x bitwise (``torch.equal``)."""
    rank = dist.get_rank()
    x, ids, weights = dyadic_inputs(spec, rank)
    layer = build_layer(spec)
    dev = device()
    try:
        x, ids, weights = x.to(dev), ids.to(dev), weights.to(dev)
        dispatched = dispatch_only(layer, x, ids, weights)
        out = layer.dispatcher.combine(weighted_identity(dispatched), dispatched)
    finally:
        layer.close()
    total_weight = torch.where(ids >= 0, weights, torch.zeros_like(weights)).sum(1, keepdim=True)
    expected = (total_weight * x.float()).to(spec.dtype)
    assert torch.equal(out, expected), (
        f"rank {rank}: round trip differs at {int((out != expected).any(1).sum())} rows"
    )
    return x.size(0)


def dispatch_dyadic_inputs(spec: CaseSpec):
    """Every rank's ``dyadic_inputs`` (as the oracle), this rank's dispatched, and the range
    ``[low, high)`` of experts this rank serves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = build_layer(spec)
    inputs = [dyadic_inputs(spec, source) for source in range(world)]
    x, ids, weights = (t.to(device()) for t in inputs[rank])
    try:
        dispatched = dispatch_only(layer, x, ids, weights)
    finally:
        layer.close()
    num_local = spec.num_experts // world
    return inputs, dispatched, (rank * num_local, (rank + 1) * num_local)


def check_dispatch_bitwise(spec: CaseSpec) -> int:
    """What arrives equals, bit for bit, what was sent: rows, global ids (-1 where not served
    here) and weights. STANDARD order: (source rank, token); EXPANDED: (expert, source, token)."""
    inputs, dispatched, (low, high) = dispatch_dyadic_inputs(spec)
    ids = inputs[dist.get_rank()][1]
    num_local = high - low
    expected_rows, expected_ids, expected_weights = [], [], []
    for source, (src_x, src_ids, src_w) in enumerate(inputs):
        for token in range(src_x.size(0)):
            served = (src_ids[token] >= low) & (src_ids[token] < high)
            if not served.any():
                continue
            if spec.layout == "standard":
                expected_rows.append(src_x[token])
                expected_ids.append(torch.where(served, src_ids[token], -1))
                expected_weights.append(torch.where(served, src_w[token], 0.0))
            else:
                for slot in served.nonzero().flatten().tolist():
                    key = (int(src_ids[token, slot]), source, token)
                    expected_rows.append((key, src_x[token], src_w[token, slot]))
    hidden = dispatched.hidden_states.cpu()
    got_ids = dispatched.topk_ids.cpu()
    got_weights = dispatched.topk_weights.cpu()
    assert got_ids.dtype == torch.int32, got_ids.dtype
    valid = (got_ids >= 0).any(1)
    if spec.layout == "standard":
        assert got_ids.size(1) == ids.size(1), "STANDARD keeps K columns"
        count = len(expected_rows)
        assert int(valid.sum()) == count, (int(valid.sum()), count)
        if count:
            assert torch.equal(hidden[valid], torch.stack(expected_rows))
            assert torch.equal(got_ids[valid], torch.stack(expected_ids).to(torch.int32))
            served = got_ids[valid] >= 0
            assert torch.equal(got_weights[valid][served], torch.stack(expected_weights)[served])
        return count
    assert got_ids.size(1) == 1, "EXPANDED has one id column"
    expected_rows.sort(key=lambda item: item[0])
    count = len(expected_rows)
    assert torch.equal(valid[:count], torch.ones(count, dtype=torch.bool)), "valid rows first"
    assert not bool(valid[count:].any()), "rows past the valid count must be padding"
    offsets = dispatched.expert_offsets.cpu().tolist()
    counts = [sum(1 for key, _, _ in expected_rows if key[0] == low + e) for e in range(num_local)]
    assert offsets == [sum(counts[:e]) for e in range(num_local + 1)], (offsets, counts)
    if count:
        assert torch.equal(hidden[:count], torch.stack([row for _, row, _ in expected_rows]))
        assert got_ids[:count, 0].tolist() == [key[0] for key, _, _ in expected_rows]
        assert torch.equal(got_weights[:count, 0], torch.stack([w for _, _, w in expected_rows]))
    return count


def capacity_forward_without_sync(spec: CaseSpec) -> Comparison:
    """A capacity-mode forward under ``set_sync_debug_mode("error")``: any host sync raises."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    w13, w2 = make_weights(spec)
    ref = reference_moe(x, ids, weights, w13, w2, spec.activation)
    layer = build_layer(spec)
    dev = device()
    x, ids, weights = x.to(dev), ids.to(dev), weights.to(dev)
    try:
        layer(x, ids, weights)  # warm-up: lazy NCCL init and allocator growth may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer(x, ids, weights)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        layer.check()
    finally:
        layer.close()
    return compare_per_token(
        out, ref, tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate))
    )


def cuda_graph_replay_matches_eager(spec: CaseSpec) -> int:
    """Capture a capacity-mode forward on static ``[cap, H]`` buffers (padding rows all -1),
    replay it on new inputs and compare bitwise with an eager forward on the same inputs."""
    rank = dist.get_rank()
    dev = device()
    layer = build_layer(spec)
    cap = spec.cap
    k = spec.k or spec.top_k

    def padded_inputs(seed: int):
        x, ids, weights = make_inputs(with_spec(spec, seed=seed), rank)
        static_x = torch.zeros(cap, spec.hidden, dtype=spec.dtype)
        static_ids = torch.full((cap, k), -1, dtype=torch.int64)
        static_w = torch.zeros(cap, k)
        static_x[: x.size(0)], static_ids[: x.size(0)], static_w[: x.size(0)] = x, ids, weights
        return static_x.to(dev), static_ids.to(dev), static_w.to(dev)

    try:
        static_x, static_ids, static_w = padded_inputs(spec.seed)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                layer(static_x, static_ids, static_w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x, static_ids, static_w)
        replays = 0
        for seed in (spec.seed + 1, spec.seed + 2):
            new_x, new_ids, new_w = padded_inputs(seed)
            static_x.copy_(new_x)
            static_ids.copy_(new_ids)
            static_w.copy_(new_w)
            graph.replay()
            torch.cuda.synchronize()
            eager = layer(new_x, new_ids, new_w)
            assert torch.equal(static_out, eager), f"rank {rank}: replay differs from eager"
            replays += 1
        layer.check()
    finally:
        layer.close()
    return replays


def capacity_bad_ids_are_recorded(spec: CaseSpec) -> tuple[str, str, bool]:
    """Capacity mode on CUDA checks id values on the device: an out-of-range and a repeated id
    are dropped without a sync, ``check()`` raises naming their count, and the forward after is
    correct. Returns (check's error type, its message, next forward passed)."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    w13, w2 = make_weights(spec)
    layer = build_layer(spec)
    dev = device()
    try:
        bad = ids.clone()
        bad[0, 0] = spec.num_experts + 5  # out of range
        bad[1] = -1
        bad[1, :2] = 0  # expert 0 twice in one row
        layer(x.to(dev), bad.to(dev), weights.to(dev))
        try:
            layer.check()
            error = ("none", "")
        except Exception as raised:
            error = (type(raised).__name__, str(raised))
        ref, scale = reference_moe(x, ids, weights, w13, w2, spec.activation, return_scale=True)
        out = layer(x.to(dev), ids.to(dev), weights.to(dev))
        layer.check()
        tolerance = tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate))
        return (*error, compare_per_token(out, ref, tolerance, scale).passed)
    finally:
        layer.close()
