"""Experts backends over a token sweep: ``python -m ep_runtime.bench.experts_sweep`` (one CUDA GPU,
world size 1, ``torch_a2a``, bf16, K = 8, balanced random routing).

Per (model, T), all in one run: the layer with each (experts, layout) forward eager (synchronised
each time, so it includes the host's launch latency), eager back to back (20 forwards issued
without a sync, as a model's layers are, and the host's time to issue one), and replayed as a
CUDA graph (capacity mode, T ≤ 512; checked bitwise equal to eager): one forward per replay,
which includes the graph's launch latency, and per forward of ``GRAPH_FORWARDS`` back to back in
one graph, as the layers of a captured model run; exact mode (T > 512) runs
with ``device_checks=True``, as the transformers blocks do, so no host read ends a forward; the
bare pair of ``torch._grouped_mm`` calls on the same grouped rows; and the HBM floor: bytes of
the experts' weights the forward reads ÷ the rate of a 2 GiB device copy (read + write)
measured in this run.
Every layer's output is checked against ``reference_moe`` on a token sample first.
``--forward-graphs off`` builds the layers without their own graphs of eager forwards (with
them, the default, an eager forward of T ≤ 512 replays one).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ep_runtime import reference_moe
from ep_runtime.bench.layer import (
    Point,
    add_layer_flags,
    bare_gemms_ms,
    build_layer,
    copy_rate_bytes_per_ms,
    inputs,
    time_ms,
)
from ep_runtime.bench.timing import back_to_back_ms, graph_replay_ms
from ep_runtime.tolerance import compare_per_token, tolerance_for

BF16 = torch.bfloat16
MODELS = {  # (experts at world size 1, hidden, intermediate)
    "deepseek-v3-ep8-shard": (32, 7168, 2048),
    "qwen3-30b-a3b": (128, 2048, 768),
}
TOKENS = (1, 8, 32, 128, 512, 4096)
BACKENDS = (("triton", "standard"), ("triton", "expanded"), ("grouped_mm", "expanded"))
CAPACITY_UP_TO = 512  # T above this runs in exact mode (prefill); at or below, capacity + graph
BACK_TO_BACK = 20
GRAPH_FORWARDS = 10
SAMPLE = 64


@dataclass
class Row:
    model: str
    tokens: int
    experts: str
    layout: str
    mode: str
    forward_graphs: bool
    passed: bool
    max_rel_err: float
    eager_ms: float
    back_to_back_ms: float
    host_ms: float
    graph_ms: float | None
    in_graph_ms: float | None  # per forward, GRAPH_FORWARDS in one graph
    gemms_ms: float
    floor_ms: float


def measure_layer(
    point: Point,
    experts: str,
    data,
    device: torch.device,
    forward_graphs: bool,
    dispatcher: str = "torch_a2a",
) -> dict:
    w13, w2, x, ids, weights = data
    # exact mode as the transformers blocks build it: ids checked on the device, so a forward
    # ends without a host read and back-to-back forwards overlap the host with the GPU
    layer = build_layer(
        point,
        device,
        experts=experts,
        device_checks=point.mode == "exact",
        forward_graphs=forward_graphs,
        dispatcher=dispatcher,
    )
    try:
        layer.load_weights(w13, w2)
        out = layer(x, ids, weights)
        sample = torch.arange(0, point.tokens, max(1, point.tokens // SAMPLE))
        ref, scale = reference_moe(
            x[sample], ids[sample], weights[sample], w13, w2, return_scale=True
        )
        comparison = compare_per_token(
            out[sample], ref, tolerance_for(BF16, max(point.hidden, point.intermediate)), scale
        )
        again = layer(x, ids, weights)
        if not torch.equal(again, out):
            raise AssertionError(f"{point.name} {experts}: two eager forwards differ")
        eager_ms = time_ms(lambda: layer(x, ids, weights))
        back_to_back, host_ms = back_to_back_ms(lambda: layer(x, ids, weights), BACK_TO_BACK)
        graph_ms = in_graph_ms = None
        if point.mode == "capacity":
            graph_ms = graph_replay_ms(lambda: layer(x, ids, weights), out)
            in_graph_ms = graph_replay_ms(lambda: layer(x, ids, weights), out, GRAPH_FORWARDS)
        layer.check()
    finally:
        layer.close()
    return {
        "forward_graphs": layer.graphs is not None,
        "passed": comparison.passed,
        "max_rel_err": comparison.max_relative_error,
        "eager_ms": eager_ms,
        "back_to_back_ms": back_to_back,
        "host_ms": host_ms,
        "graph_ms": graph_ms,
        "in_graph_ms": in_graph_ms,
    }


def sweep(
    models: list[str],
    tokens: list[int],
    device: torch.device,
    rate: float,
    forward_graphs: bool,
    dispatcher: str = "torch_a2a",
) -> list[Row]:
    rows = []
    for model in models:
        num_experts, hidden, intermediate = MODELS[model]
        for count in tokens:
            mode = "capacity" if count <= CAPACITY_UP_TO else "exact"
            base = Point(model, num_experts, count, hidden, intermediate, 8, mode, "standard")
            data = inputs(base, device)
            w13, w2, _, ids, _ = data
            touched = torch.zeros(num_experts, dtype=torch.bool, device=device)
            touched[ids.flatten().long()] = True
            floor_ms = int(touched.sum()) * (w13[0].nbytes + w2[0].nbytes) / rate
            gemms_ms = bare_gemms_ms(*data)
            for experts, layout in BACKENDS:
                point = Point(**{**asdict(base), "layout": layout})
                got = measure_layer(point, experts, data, device, forward_graphs, dispatcher)
                row = Row(
                    model, count, experts, layout, mode, **got, gemms_ms=gemms_ms, floor_ms=floor_ms
                )
                print(json.dumps(asdict(row)), flush=True)
                rows.append(row)
            del data, w13, w2
    return rows


def print_table(rows: list[Row], rate: float) -> None:
    print(f"device copy (2 GiB, read + write): {rate / 1e9:.2f} TB/s")
    print(
        f"{'model':22} {'T':>5} {'experts':10} {'layout':9} {'ok':3} {'eager':>7} {'b2b':>7} "
        f"{'host':>6} {'graph':>7} {'graph10':>7} {'GEMMs':>7} {'floor':>7} {'best/GEMMs':>10} "
        f"{'best/floor':>10} {'g10/floor':>9}"
    )
    for r in rows:
        best = r.graph_ms if r.graph_ms is not None else r.eager_ms
        graph = "-" if r.graph_ms is None else f"{r.graph_ms:7.3f}"
        in_graph = "-" if r.in_graph_ms is None else f"{r.in_graph_ms:7.3f}"
        in_graph_ratio = "-" if r.in_graph_ms is None else f"{r.in_graph_ms / r.floor_ms:9.2f}"
        print(
            f"{r.model:22} {r.tokens:5d} {r.experts:10} {r.layout:9} "
            f"{'yes' if r.passed else 'NO':3} {r.eager_ms:7.3f} {r.back_to_back_ms:7.3f} "
            f"{r.host_ms:6.3f} {graph:>7} {in_graph:>7} {r.gemms_ms:7.3f} {r.floor_ms:7.3f} "
            f"{best / r.gemms_ms:10.2f} {best / r.floor_ms:10.2f} {in_graph_ratio:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench.experts_sweep", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    add_layer_flags(parser)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: experts_sweep needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    rate = copy_rate_bytes_per_ms(device)
    rows = sweep(
        args.models, args.tokens, device, rate, args.forward_graphs == "on", args.dispatcher
    )
    print_table(rows, rate)
    if args.json is not None:
        report = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "copy_tb_per_s": rate / 1e9,
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
