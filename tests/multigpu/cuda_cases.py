"""Rank side of the CUDA-only properties of capacity mode: no host sync, CUDA-graph replay equal
to eager, failures recorded on the device."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ep_runtime import reference_moe
from ep_runtime.tolerance import Comparison, compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import (
    CaseSpec,
    build_layer,
    device,
    make_inputs,
    make_weights,
    with_spec,
)


def capacity_forward_without_sync(spec: CaseSpec) -> Comparison:
    """A capacity-mode forward under ``set_sync_debug_mode("error")``: any host sync raises.
    Two warm-ups first (lazy NCCL init and allocator growth may sync; at world size one the
    second captures the layer's graph of the forward, so the measured one is its replay)."""
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    w13, w2 = make_weights(spec)
    ref = reference_moe(x, ids, weights, w13, w2, spec.activation)
    layer = build_layer(spec)
    dev = device()
    x, ids, weights = x.to(dev), ids.to(dev), weights.to(dev)
    try:
        for _ in range(2):
            layer(x, ids, weights)
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
