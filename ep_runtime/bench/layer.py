"""The layer against its own GEMMs: ``python -m ep_runtime.bench`` (one CUDA GPU, world size 1).

Per point and experts backend (``triton``, ``grouped_mm``), all measured in one run: the layer
forward (eager, and replayed as a CUDA graph in capacity mode), the same two
``torch._grouped_mm`` calls alone on the same grouped rows, their ratio, the CUDA kernels one
eager forward launches (torch.profiler), and the HBM floor: the bytes of the expert weights the
forward reads ÷ the rate of a 2 GiB device-to-device copy (read + write) measured in the same
run. Every point's output is checked against ``reference_moe`` on a token sample first.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ep_runtime import EPMoE, MoEConfig, reference_moe
from ep_runtime.bench.timing import (
    copy_rate_bytes_per_ms,
    device_activity,
    graph_replay_ms,
    time_ms,
)
from ep_runtime.forward_graphs import DEFAULT_GRAPH_POLICY
from ep_runtime.kernels import resolve_ops
from ep_runtime.tolerance import compare_per_token, tolerance_for

BF16 = torch.bfloat16
VALIDATED_TOKENS = 128


@dataclass(frozen=True)
class Point:
    name: str
    num_experts: int  # the rank's experts (world size 1: all of them)
    tokens: int
    hidden: int
    intermediate: int
    top_k: int
    mode: str
    layout: str


POINTS = {
    point.name: point
    for point in (
        Point("deepseek-v3-ep8-shard-prefill", 32, 4096, 7168, 2048, 8, "exact", "expanded"),
        Point("qwen3-30b-a3b-prefill", 128, 4096, 2048, 768, 8, "exact", "expanded"),
        Point("deepseek-v3-ep8-shard-decode", 32, 128, 7168, 2048, 8, "capacity", "expanded"),
        Point("qwen3-30b-a3b-decode", 128, 128, 2048, 768, 8, "capacity", "expanded"),
    )
}


@dataclass
class Measured:
    point: str
    experts: str
    layout: str
    mode: str
    forward_graphs: bool  # eager forwards may replay the layer's own graph (where it takes them)
    passed: bool
    max_rel_err: float
    layer_ms: float
    gemms_ms: float
    gemms_over_layer: float
    kernels_per_forward: int
    copies_per_forward: int
    graph_ms: float | None
    graph_over_gemms: float | None
    hbm_floor_ms: float
    graph_over_floor: float | None
    eager_over_gemms: float


def inputs(point: Point, device: torch.device, seed: int = 0, dtype: torch.dtype = BF16):
    """Weights, tokens, and balanced routing (distinct random experts per token)."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = point.num_experts, point.hidden, point.intermediate
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=device, generator=g) / i**0.5).to(dtype)
    x = torch.randn(point.tokens, h, device=device, generator=g).to(dtype)
    scores = torch.rand(point.tokens, e, device=device, generator=g)
    ids = scores.topk(point.top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(point.tokens, point.top_k, device=device, generator=g)
    return w13, w2, x, ids, weights


def build_layer(
    point: Point,
    device: torch.device,
    dtype: torch.dtype = BF16,
    experts: str = "grouped_mm",
    quantization: str | None = None,
    device_checks: bool = False,
    forward_graphs: bool = True,
    dispatcher: str = "torch_a2a",
) -> EPMoE:
    """The layer of one point: ``dispatcher`` + ``experts``, world size 1; ``forward_graphs``
    False: every eager forward runs its kernels (no graph of the layer's own)."""
    config = MoEConfig(
        point.num_experts,
        point.top_k,
        point.hidden,
        point.intermediate,
        dtype=dtype,
        max_tokens_per_rank=point.tokens,
        quantization=quantization,
    )
    return EPMoE(
        config,
        dispatcher=dispatcher,
        experts=experts,
        layout=point.layout,
        mode=point.mode,
        device=device,
        device_checks=device_checks,
        forward_graphs=DEFAULT_GRAPH_POLICY if forward_graphs else None,
    )


def bare_gemms_ms(w13, w2, x, ids, weights) -> float:
    """The two ``torch._grouped_mm`` calls alone on the grouped rows of this routing."""
    num_experts = w13.size(0)
    ops = resolve_ops(x.device)
    grouped = ops.group_rows(  # the rows the expanded layout hands the GEMMs at world size 1
        x, ids, weights, local_offset=0, num_local=num_experts, num_rows=ids.numel()
    )
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    ends = grouped.offsets[1:]
    activated = ops.weighted_activation(
        torch._grouped_mm(grouped.hidden, w13_t, offs=ends), grouped.weights, gated=True
    )

    def gemms() -> None:
        torch._grouped_mm(grouped.hidden, w13_t, offs=ends)
        torch._grouped_mm(activated, w2_t, offs=ends)

    return time_ms(gemms)


def measure(
    point: Point,
    rate: float,
    device: torch.device,
    experts: str,
    forward_graphs: bool,
    dispatcher: str,
) -> tuple[Measured, dict]:
    w13, w2, x, ids, weights = inputs(point, device)
    layer = build_layer(
        point, device, experts=experts, forward_graphs=forward_graphs, dispatcher=dispatcher
    )
    try:
        layer.load_weights(w13, w2)
        out = layer(x, ids, weights)
        sample = torch.arange(0, point.tokens, max(1, point.tokens // VALIDATED_TOKENS))
        ref, scale = reference_moe(
            x[sample], ids[sample], weights[sample], w13, w2, return_scale=True
        )
        comparison = compare_per_token(
            out[sample], ref, tolerance_for(BF16, max(point.hidden, point.intermediate)), scale
        )
        layer_ms = time_ms(lambda: layer(x, ids, weights))
        activity = device_activity(lambda: layer(x, ids, weights))
        gemms_ms = bare_gemms_ms(w13, w2, x, ids, weights)
        graph_ms = None
        if point.mode == "capacity":
            graph_ms = graph_replay_ms(lambda: layer(x, ids, weights), out)
        layer.check()
    finally:
        layer.close()
    touched = torch.zeros(point.num_experts, dtype=torch.bool, device=device)
    touched[ids.flatten().long()] = True
    weight_bytes = int(touched.sum()) * (w13[0].nbytes + w2[0].nbytes)
    floor_ms = weight_bytes / rate
    result = Measured(
        point=point.name,
        experts=experts,
        layout=point.layout,
        mode=point.mode,
        forward_graphs=layer.graphs is not None,
        passed=comparison.passed,
        max_rel_err=comparison.max_relative_error,
        layer_ms=layer_ms,
        gemms_ms=gemms_ms,
        gemms_over_layer=gemms_ms / layer_ms,
        kernels_per_forward=activity.num_kernels,
        copies_per_forward=activity.num_copies,
        graph_ms=graph_ms,
        graph_over_gemms=None if graph_ms is None else graph_ms / gemms_ms,
        hbm_floor_ms=floor_ms,
        graph_over_floor=None if graph_ms is None else graph_ms / floor_ms,
        eager_over_gemms=layer_ms / gemms_ms,
    )
    return result, activity.kernels


def add_layer_flags(parser: argparse.ArgumentParser) -> None:
    """``--forward-graphs`` and ``--dispatcher``: how the benches build their layers."""
    parser.add_argument(
        "--dispatcher",
        choices=["torch_a2a", "local"],
        default="torch_a2a",
        help="the transport at world size 1: torch_a2a (packed rows, as every earlier figure) "
        "or local (nothing packed or moved)",
    )
    parser.add_argument(
        "--forward-graphs",
        choices=["on", "off"],
        default="on",
        help="the layers' CUDA graphs of their own eager forwards (on: the default a user gets; "
        "off: every eager forward launches its kernels)",
    )


def print_table(results: list[Measured], rate: float) -> None:
    print(f"device copy (2 GiB, read + write): {rate / 1e9:.0f} TB/s")
    header = (
        f"{'point':32} {'experts':10} {'layout':9} {'mode':9} {'ok':3} {'layer ms':>9} "
        f"{'GEMMs ms':>9} {'GEMMs/layer':>11} {'kernels':>7} {'graph ms':>9} {'graph/GEMMs':>11} "
        f"{'floor ms':>9} {'graph/floor':>11}"
    )
    print(header)
    for r in results:
        graph = "-" if r.graph_ms is None else f"{r.graph_ms:9.3f}"
        over_gemms = "-" if r.graph_over_gemms is None else f"{r.graph_over_gemms:11.2f}"
        over_floor = "-" if r.graph_over_floor is None else f"{r.graph_over_floor:11.2f}"
        print(
            f"{r.point:32} {r.experts:10} {r.layout:9} {r.mode:9} {'yes' if r.passed else 'NO':3} "
            f"{r.layer_ms:9.3f} {r.gemms_ms:9.3f} {r.gemms_over_layer:11.2f} "
            f"{r.kernels_per_forward:7d} {graph:>9} {over_gemms:>11} {r.hbm_floor_ms:9.3f} "
            f"{over_floor:>11}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--points", nargs="+", choices=sorted(POINTS), default=list(POINTS))
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=["expanded", "standard"],
        default=["expanded"],
        help="layouts to run each point in (the GEMM baseline is the same in both)",
    )
    parser.add_argument(
        "--experts",
        nargs="+",
        choices=["triton", "grouped_mm"],
        default=["triton", "grouped_mm"],
        help="experts backends to run each point with (the GEMM baseline is the same for all)",
    )
    add_layer_flags(parser)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: python -m ep_runtime.bench needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    rate = copy_rate_bytes_per_ms(device)
    results, names = [], {}
    for name in args.points:
        for experts in args.experts:
            for layout in args.layouts:
                point = Point(**{**asdict(POINTS[name]), "layout": layout})
                measured, kernel_names = measure(
                    point, rate, device, experts, args.forward_graphs == "on", args.dispatcher
                )
                results.append(measured)
                names[f"{name}/{experts}/{layout}"] = kernel_names
                print(json.dumps(asdict(measured)), flush=True)
    print_table(results, rate)
    if args.json is not None:
        report = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "copy_tb_per_s": rate / 1e9,
            "results": [asdict(r) for r in results],
            "kernel_names": names,
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r.passed for r in results) else 1
