"""The fp8 block-scale layer beside the bf16 layer: ``python -m ep_runtime.bench.fp8`` (one CUDA
GPU, world size 1, STANDARD, K = 8, balanced routing; ``--dispatcher``
``torch_a2a`` (the default, as every earlier figure) or ``local``, the one ``"auto"`` takes at a
world of one).

Each point runs with both layers on the ``triton`` experts; the prefill point also with the
other fp8 experts (``scaled_mm``, cuBLAS's block-scaled GEMM per expert; ``deepgemm``, DeepGEMM's
m-grouped GEMM, what ``"auto"`` takes where ``deep_gemm`` is installed) against ``triton`` and
``grouped_mm`` (bf16's ``"auto"`` choice); ``deepgemm`` also at the DeepSeek-V3 decode point.
Rows whose backend cannot run here are printed with the reason, not timed.
Per point, in one run: weights generated in bf16 and quantized per 128×128 block; the fp8 layer
(fp8 dispatch: rows sent as e4m3 + scales) on the quantized weights and the bf16 layer on the
same weights dequantized. Decode points (T = 128, capacity mode) are timed replayed as CUDA
graphs (checked bitwise equal to eager): one forward per replay (the figure includes the graph's
launch latency) and, per forward, ten back to back in one graph (as a captured model's layers
run); prefill (T = 4096, exact mode) eager: one forward synced (it includes the host's lead
before the first kernel) and, per forward, twenty issued back to back without a sync (as a
model's layers are, the host's launches overlapping the previous forward). Printed: both
times and their ratio, the fp8 layer against the fp8 twin (``experts="reference"``, the
contract in plain torch) on a token sample, the per-token distance between the fp8 and the bf16
layer, and the dispatch bytes of one packed row in each format.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ep_runtime import EPMoE, MoEConfig
from ep_runtime.bench.layer import Point, add_layer_flags, build_layer, inputs, time_ms
from ep_runtime.bench.timing import back_to_back_ms, graph_replay_ms
from ep_runtime.experts import EXPERTS, ExpertsSetup
from ep_runtime.kernels.layout import RowFormat
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import dequantize_weight_blocks, quantize_weight_blocks
from ep_runtime.tolerance import compare_per_token, tolerance_for

BF16 = torch.bfloat16
POINTS = (
    Point("deepseek-v3-ep8-shard-decode", 32, 128, 7168, 2048, 8, "capacity", "standard"),
    Point("qwen3-30b-a3b-decode", 128, 128, 2048, 768, 8, "capacity", "standard"),
    Point("deepseek-v3-ep8-shard-prefill", 32, 4096, 7168, 2048, 8, "exact", "standard"),
)
# (point, fp8 experts, bf16 experts): each point with both layers' Triton experts, then the
# other fp8 experts against the bf16 Triton experts and grouped_mm ("auto"'s bf16 choice)
RUNS = (
    (POINTS[0], "triton", "triton"),
    (POINTS[0], "deepgemm", "triton"),
    (POINTS[1], "triton", "triton"),
    (POINTS[2], "triton", "triton"),
    (POINTS[2], "scaled_mm", "triton"),
    (POINTS[2], "scaled_mm", "grouped_mm"),
    (POINTS[2], "deepgemm", "triton"),
    (POINTS[2], "deepgemm", "grouped_mm"),
)
SAMPLE = 64  # tokens checked against the twin
GRAPH_FORWARDS = 10  # forwards in one graph for the in-graph time (a captured model's layers)
BACK_TO_BACK = 20  # eager forwards issued without a sync (a model's layers)


@dataclass
class Fp8Row:
    point: str
    fp8_experts: str
    bf16_experts: str
    bf16_ms: float
    fp8_ms: float
    ratio: float
    timed: str  # "graph" (one forward per replay) or "eager" (one forward, synced)
    bf16_ms_many: float  # per forward of many: GRAPH_FORWARDS in one graph or BACK_TO_BACK eager
    fp8_ms_many: float
    ratio_many: float
    twin_passed: bool
    twin_max_rel_err: float
    distance_median: float  # per-token ‖fp8 − bf16‖ / ‖bf16‖ on the same dequantized weights
    distance_max: float
    bf16_row_bytes: int
    fp8_row_bytes: int


def timed_forward(layer: EPMoE, x, ids, weights, graph: bool) -> tuple[torch.Tensor, float, float]:
    """``(output, ms of one, ms per forward of many)``: CUDA-graph replays of one forward and of
    ``GRAPH_FORWARDS`` in one graph (both checked equal to eager), or one synced eager forward
    (median) and ``BACK_TO_BACK`` eager forwards issued without a sync."""
    out = layer(x, ids, weights).clone()
    if not torch.equal(layer(x, ids, weights), out):
        raise AssertionError("two eager forwards differ")
    forward = lambda: layer(x, ids, weights)  # noqa: E731
    if not graph:
        return out, time_ms(forward), back_to_back_ms(forward, BACK_TO_BACK)[0]
    return out, graph_replay_ms(forward, out), graph_replay_ms(forward, out, GRAPH_FORWARDS)


def measure(
    point: Point,
    device: torch.device,
    fp8_experts: str = "triton",
    bf16_experts: str = "triton",
    **layer_options,
) -> Fp8Row:
    """One point's row; ``layer_options`` (dispatcher, forward_graphs) build both layers.
    Exact mode checks the ids on the device (as the sweep and the transformers blocks do), so
    no host read ends a forward."""
    layer_options = {**layer_options, "device_checks": point.mode == "exact"}
    w13, w2, x, ids, weights = inputs(point, device)
    q13, s13 = quantize_weight_blocks(w13)
    q2, s2 = quantize_weight_blocks(w2)
    del w13, w2
    graph = point.mode == "capacity"
    fp8 = build_layer(point, device, experts=fp8_experts, quantization="fp8_block", **layer_options)
    try:
        fp8.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        out_fp8, fp8_ms, fp8_many = timed_forward(fp8, x, ids, weights, graph)
    finally:
        fp8.close()
    sample = torch.arange(0, point.tokens, max(1, point.tokens // SAMPLE), device=device)
    twin = build_layer(point, device, experts="reference", quantization="fp8_block")
    try:
        twin.load_weights(q13, q2, w13_scale_inv=s13, w2_scale_inv=s2)
        ref = twin(x[sample], ids[sample], weights[sample])
    finally:
        twin.close()
    tolerance = tolerance_for(BF16, max(point.hidden, point.intermediate))
    comparison = compare_per_token(out_fp8[sample], ref.double(), tolerance)
    bf16 = build_layer(point, device, experts=bf16_experts, **layer_options)
    try:
        bf16.load_weights(
            dequantize_weight_blocks(q13, s13).to(BF16), dequantize_weight_blocks(q2, s2).to(BF16)
        )
        out_bf16, bf16_ms, bf16_many = timed_forward(bf16, x, ids, weights, graph)
    finally:
        bf16.close()
    distance = (out_fp8.double() - out_bf16.double()).norm(dim=1) / out_bf16.double().norm(dim=1)
    rows = [RowFormat(point.hidden, BF16, point.top_k, quantized=q).row_bytes for q in (0, 1)]
    return Fp8Row(
        point.name,
        fp8_experts,
        bf16_experts,
        bf16_ms,
        fp8_ms,
        fp8_ms / bf16_ms,
        "graph" if graph else "eager",
        bf16_many,
        fp8_many,
        fp8_many / bf16_many,
        comparison.passed,
        comparison.max_relative_error,
        distance.median().item(),
        distance.max().item(),
        *rows,
    )


def fp8_refusal(point: Point, device: torch.device, experts: str) -> str | None:
    """Why the fp8 experts backend cannot run this point here (a package, the GPU), else None."""
    config = MoEConfig(
        point.num_experts, point.top_k, point.hidden, point.intermediate, dtype=BF16,
        quantization="fp8_block",
    )  # fmt: skip
    placement = ExpertPlacement(point.num_experts, 0, 1)
    setup = ExpertsSetup(config, placement, device, BF16, token_cap=point.tokens)
    return EXPERTS[experts].refusal(setup, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    add_layer_flags(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, dispatcher "
        f"{args.dispatcher}, forward graphs {args.forward_graphs}"
    )
    options = {"dispatcher": args.dispatcher, "forward_graphs": args.forward_graphs == "on"}
    header = (
        f"{'point [fp8 / bf16 experts]':54} {'bf16 ms':>9} {'fp8 ms':>9} {'ratio':>6} {'timed':>6}"
    )
    print(
        f"'many' = per forward of {GRAPH_FORWARDS} in one graph (graph rows) or of "
        f"{BACK_TO_BACK} eager forwards issued back to back (eager rows)"
    )
    many_header = "many: bf16/fp8 ms, ratio"
    print(f"{header}  {many_header:34}  twin (max rel)  fp8-vs-bf16 (median/max)  row bytes")
    rows = []
    for point, fp8_experts, bf16_experts in RUNS:
        label = f"{point.name} [{fp8_experts} / {bf16_experts}]"
        refusal = fp8_refusal(point, device, fp8_experts)
        if refusal is not None:
            print(f"{label:54} not run: {fp8_experts} {refusal}")
            continue
        row = measure(point, device, fp8_experts, bf16_experts, **options)
        rows.append(row)
        many = f"{row.bf16_ms_many:9.4f} {row.fp8_ms_many:9.4f} {row.ratio_many:6.3f}"
        print(
            f"{label:54} {row.bf16_ms:9.4f} {row.fp8_ms:9.4f} {row.ratio:6.3f} "
            f"{row.timed:>6}  {many:34}  {'pass' if row.twin_passed else 'FAIL'} "
            f"{row.twin_max_rel_err:.2e}   {row.distance_median:.2e} / {row.distance_max:.2e}"
            f"     {row.bf16_row_bytes}/{row.fp8_row_bytes}"
        )
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.twin_passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
