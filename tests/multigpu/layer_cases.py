"""Rank side of the layer cases: run the layer (optionally with an injected bug, the negative
controls) and compare every rank with ``reference_moe`` per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ep_runtime import reference_moe
from ep_runtime.tolerance import Comparison, compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import CaseSpec, build_layer, device, make_inputs, make_weights


@dataclass(frozen=True)
class CaseResult:
    rank: int
    comparison: Comparison
    dispatcher: str
    experts: str
    layout: str
    output: torch.Tensor


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
