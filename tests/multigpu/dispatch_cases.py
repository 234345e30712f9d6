"""Rank side of the dispatcher-only properties: what arrives equals what was sent, bit for bit,
and a round trip through a weighted identity is exact."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.multigpu.rank_inputs import CaseSpec, build_layer, device, dispatch_only, dyadic_inputs


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
