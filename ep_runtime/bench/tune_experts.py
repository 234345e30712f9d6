"""Tune the ``triton`` experts' tile configs: ``python -m ep_runtime.bench.tune_experts``.

``--quantization fp8_block`` tunes the fp8 block-scale GEMMs (``experts/gemm/expert_gemm_fp8.py``)
instead, on weights quantized per 128×128 block and rows quantized per 128 columns; their
entries are keyed apart (prefix ``fp8_``).

For each model shape and token count, routes T tokens (balanced random, distinct experts per
token, world size 1, STANDARD layout: rows gathered through the sorted pairs), times every
candidate config of each GEMM (``expert_up``, ``expert_down``) and the table's own entry for the
point (so a run never writes a slower config) on the device alone (CUDA graphs of several calls,
L2 evicted before each: ``bench.timing.device_ms``; an event-timed single call at decode mostly
times the host's launch), checks the winner against the kernels' torch spec, and
merges the best per (GEMM, L, N, K, rows-per-expert bucket) into the table shipped in the
package (``ep_runtime/experts/gemm/expert_tiles.json``), under this GPU's name; token counts sharing
a bucket get the config best over all of them. One CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from ep_runtime.bench.timing import device_ms
from ep_runtime.experts.gemm.expert_gemm import (
    expert_down,
    expert_down_spec,
    expert_up,
    expert_up_spec,
)
from ep_runtime.experts.gemm.expert_gemm_fp8 import (
    expert_down_fp8,
    expert_down_fp8_spec,
    expert_up_fp8,
    expert_up_fp8_spec,
)
from ep_runtime.experts.gemm.expert_rows import sort_pairs
from ep_runtime.experts.gemm.expert_tiles import (
    TileConfig,
    parse_table,
    rows_bucket,
    shape_key,
    table_path,
)
from ep_runtime.quantization import (
    FP8_DTYPE,
    dequantize_activations,
    quantize_activations,
    quantize_weight_blocks,
)

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    name: str
    num_local: int
    hidden: int
    intermediate: int
    top_k: int = 8


SHAPES = {
    s.name: s
    for s in (
        Shape("deepseek-v3-ep8-shard", 32, 7168, 2048),
        Shape("qwen3-30b-a3b", 128, 2048, 768),
    )
}
TOKENS = (1, 8, 32, 128, 512, 4096)


def candidates(bucket: Fraction) -> list[TileConfig]:
    """The configs tried for a rows-per-expert bucket: few-row tiles (plain and swapped) for
    decode, large tiles with grouped ordering for prefill, both in between. Kept short: every
    config is a compile of each kernel."""
    decode = [
        TileConfig(16, 64, 128, 1, 4, 4),
        TileConfig(16, 128, 128, 1, 4, 4),
        TileConfig(16, 32, 256, 1, 4, 4),
        TileConfig(16, 64, 256, 1, 4, 3),
        TileConfig(16, 128, 64, 1, 4, 5),
        TileConfig(16, 64, 128, 1, 4, 4, swap=True),
        TileConfig(16, 128, 128, 1, 4, 4, swap=True),
        TileConfig(16, 128, 64, 1, 4, 5, tiles_n=2),
        TileConfig(16, 64, 128, 1, 4, 4, tiles_n=2),
        TileConfig(16, 128, 128, 1, 4, 4, swap=True, tiles_n=2),
        TileConfig(16, 64, 128, 1, 4, 4, swap=True, tiles_n=4),
    ]
    middle = [
        TileConfig(32, 64, 128, 1, 4, 4),
        TileConfig(32, 128, 128, 1, 4, 4),
        TileConfig(32, 64, 256, 1, 4, 3),
        TileConfig(64, 64, 128, 4, 4, 4),
        TileConfig(64, 128, 64, 4, 4, 4),
        TileConfig(32, 128, 128, 1, 4, 4, swap=True),
        TileConfig(32, 128, 128, 1, 4, 4, tiles_n=2),
        TileConfig(64, 128, 64, 4, 4, 4, tiles_n=2),
    ]
    prefill = [
        TileConfig(64, 128, 64, 8, 4, 4),
        TileConfig(128, 64, 64, 8, 4, 4),
        TileConfig(128, 128, 64, 8, 8, 3),
        TileConfig(128, 128, 64, 8, 8, 4),
        TileConfig(128, 256, 64, 8, 8, 3),
        TileConfig(256, 128, 64, 8, 8, 3),
        TileConfig(128, 128, 64, 16, 8, 4),
        TileConfig(128, 64, 128, 8, 8, 3),
        TileConfig(128, 128, 128, 8, 8, 3),
        TileConfig(128, 256, 64, 8, 8, 4),
    ]
    few_experts = [  # fewer rows than experts (T 1): narrower column tiles, more programs
        TileConfig(16, 32, 128, 1, 4, 4),
        TileConfig(16, 32, 128, 1, 4, 4, swap=True),
        TileConfig(16, 32, 256, 1, 4, 3, swap=True),
        TileConfig(16, 64, 256, 1, 4, 3, swap=True),
        TileConfig(16, 64, 128, 1, 2, 4, swap=True),
        TileConfig(16, 64, 128, 1, 4, 6, swap=True),
    ]
    if bucket < 1:
        return decode + few_experts
    if bucket <= 16:
        return decode
    if bucket <= 64:
        return middle + prefill[:2]
    return prefill


def fp8_candidates(bucket: Fraction, gemm: str) -> list[TileConfig]:
    """The fp8 GEMMs' configs: BLOCK_K = 128 (one scale per k-step) or 256 (two k-steps per
    loop iteration), BLOCK_N dividing 128 (a column tile lies in one weight block: one weight
    scale per k-step) and, for GEMM1, BLOCK_N = 128 (its epilogue quantizes one 128-column
    group per tile row); each with its operands loaded through pointers and through TMA
    (``tma``; GEMM1 is timed in STANDARD, its rows gathered, so only its weights go through
    TMA here)."""
    decode = [
        TileConfig(16, 128, 128, 1, 4, 3, swap=True),
        TileConfig(16, 128, 128, 1, 4, 4, swap=True),
        TileConfig(16, 128, 128, 1, 4, 5, swap=True),
        TileConfig(16, 128, 128, 1, 4, 4),
        TileConfig(32, 128, 128, 1, 4, 4, swap=True),
        TileConfig(16, 64, 128, 1, 4, 4, swap=True),
        TileConfig(16, 64, 128, 1, 4, 5, swap=True),
        TileConfig(16, 64, 128, 1, 2, 4, swap=True),
        TileConfig(16, 64, 128, 1, 4, 3, swap=True),
        TileConfig(16, 128, 128, 1, 8, 4, swap=True),
        TileConfig(16, 128, 128, 1, 2, 4, swap=True),
        TileConfig(32, 64, 128, 1, 4, 4, swap=True),
        TileConfig(16, 128, 128, 1, 4, 3, swap=True, tiles_n=2),
        TileConfig(16, 128, 128, 1, 4, 4, swap=True, tiles_n=3),
        TileConfig(16, 128, 128, 1, 4, 4, tiles_n=2),
        TileConfig(16, 64, 128, 1, 4, 4, swap=True, tiles_n=2),
        TileConfig(16, 64, 128, 1, 4, 5, swap=True, tiles_n=4),
        TileConfig(16, 128, 128, 1, 4, 6, swap=True),
        TileConfig(16, 128, 128, 1, 8, 5, swap=True),
        TileConfig(16, 64, 128, 1, 4, 6, swap=True),
        TileConfig(32, 128, 128, 1, 4, 5, swap=True),
        TileConfig(16, 128, 128, 1, 4, 6, swap=True, tiles_n=2),
        # two 128-deep blocks per loop iteration: bf16's bytes per pipeline stage
        TileConfig(16, 128, 256, 1, 4, 2, swap=True),
        TileConfig(16, 128, 256, 1, 4, 3, swap=True),
        TileConfig(16, 128, 256, 1, 8, 3, swap=True),
        TileConfig(16, 64, 256, 1, 4, 3, swap=True),
        TileConfig(16, 64, 256, 1, 4, 4, swap=True),
    ]
    middle = [
        TileConfig(32, 128, 128, 1, 4, 4, swap=True),
        TileConfig(32, 128, 128, 1, 4, 5, swap=True),
        TileConfig(32, 128, 128, 1, 4, 5),
        TileConfig(32, 128, 128, 1, 4, 4),
        TileConfig(64, 128, 128, 4, 4, 3),
        TileConfig(64, 128, 128, 8, 4, 4),
        TileConfig(64, 64, 128, 8, 4, 4),
        TileConfig(32, 64, 128, 1, 4, 4, swap=True),
        TileConfig(32, 128, 128, 1, 4, 4, swap=True, tiles_n=2),
        TileConfig(32, 128, 128, 1, 4, 4, tiles_n=2),
        TileConfig(64, 128, 128, 8, 4, 4, tiles_n=2),
        # one row tile per expert where ~32 rows each (DSV3 T 128): 8 warps hold GEMM1's two
        # fp32 accumulators and their k-step partial products without spilling
        TileConfig(64, 128, 128, 1, 8, 4),
        TileConfig(64, 128, 128, 1, 8, 5),
        TileConfig(64, 128, 128, 1, 8, 3, swap=True),
        TileConfig(64, 128, 128, 1, 8, 4, swap=True),
        TileConfig(64, 64, 128, 1, 4, 4, swap=True),
        TileConfig(64, 64, 128, 1, 4, 5),
        TileConfig(64, 128, 256, 1, 8, 2),
        TileConfig(32, 128, 256, 1, 4, 3, swap=True),
        TileConfig(64, 128, 256, 8, 4, 3),
    ]
    prefill = [
        TileConfig(64, 128, 128, 8, 4, 3),
        TileConfig(64, 128, 128, 8, 4, 4),
        TileConfig(128, 128, 128, 8, 4, 3),
        TileConfig(128, 128, 128, 8, 8, 3),
        TileConfig(128, 128, 128, 8, 8, 4),
        TileConfig(128, 128, 128, 16, 8, 3),
        TileConfig(128, 64, 128, 8, 4, 4),
        TileConfig(64, 128, 128, 8, 8, 4),
        TileConfig(256, 128, 128, 8, 8, 3),
        TileConfig(128, 128, 256, 8, 8, 2),
        TileConfig(64, 128, 256, 8, 8, 2),
        TileConfig(128, 128, 256, 8, 8, 3),
        # 16 warps: GEMM1's four fp32 tiles of 128×128 (two accumulators, two partial
        # products) in 128 registers a thread
        TileConfig(128, 128, 128, 8, 16, 3),
        TileConfig(128, 128, 128, 8, 16, 4),
        TileConfig(256, 128, 128, 8, 16, 3),
    ]
    chosen = decode if bucket <= 16 else middle + prefill[:3] if bucket <= 64 else prefill
    fitting = [c for c in chosen if gemm == "down" or c.block_n == 128]
    return fitting + [dataclasses.replace(c, tma=True) for c in fitting]


def problem(shape: Shape, tokens: int, device: torch.device, seed: int = 0):
    """Weights, rows, routing and the sorted pairs of one (shape, T)."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_local, shape.hidden, shape.intermediate
    w13 = (torch.randn(e, 2 * i, h, device=device, generator=g) / h**0.5).to(BF16)
    w2 = (torch.randn(e, h, i, device=device, generator=g) / i**0.5).to(BF16)
    x = torch.randn(tokens, h, device=device, generator=g).to(BF16)
    scores = torch.rand(tokens, e, device=device, generator=g)
    ids = scores.topk(shape.top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, shape.top_k, device=device, generator=g)
    pairs = torch.empty(tokens * shape.top_k, dtype=torch.int32, device=device)
    offsets = torch.empty(e + 1, dtype=torch.int32, device=device)
    sort_pairs(ids, pairs, offsets, local_offset=0, num_local=e)
    return w13, w2, x, ids, weights, pairs, offsets


def _runs(shape: Shape, tokens: int, device: torch.device, fp8: bool):
    """``{gemm: (run(config), result(), spec result, rows compared)}`` for one (shape, T)."""
    w13, w2, x, _, weights, pairs, offsets = problem(shape, tokens, device)
    num_pairs, k = pairs.numel(), shape.top_k
    served = pairs[: int(offsets[-1])].long()
    per_pair = torch.empty(num_pairs, shape.hidden, dtype=BF16, device=device)
    if not fp8:
        act = torch.empty(num_pairs, shape.intermediate, dtype=BF16, device=device)
        up_spec = expert_up_spec(x, w13, offsets, pairs, top_k=k, gated=True)
        down_spec = expert_down_spec(up_spec, w2, offsets, pairs, weights, num_out=num_pairs)
        return {
            "up": (
                lambda c: expert_up(x, w13, offsets, pairs, act, top_k=k, gated=True, config=c),
                lambda: act,
                up_spec,
                slice(0, num_pairs),
            ),
            "down": (
                lambda c: expert_down(up_spec, w2, offsets, pairs, weights, per_pair, config=c),
                lambda: per_pair,
                down_spec,
                served,
            ),
        }
    (q13, s13), (q2, s2) = quantize_weight_blocks(w13), quantize_weight_blocks(w2)
    x_q, x_s = quantize_activations(x)
    act_q = torch.empty(num_pairs, shape.intermediate, dtype=FP8_DTYPE, device=device)
    act_s = torch.empty(num_pairs, shape.intermediate // 128, device=device)
    spec_q, spec_s = expert_up_fp8_spec(x_q, x_s, q13, s13, offsets, pairs, top_k=k, gated=True)
    down_spec = expert_down_fp8_spec(
        spec_q, spec_s, q2, s2, offsets, pairs, weights, num_out=num_pairs, dtype=BF16
    )
    return {
        "up": (
            lambda c: expert_up_fp8(
                x_q, x_s, q13, s13, offsets, pairs, act_q, act_s, top_k=k, gated=True, config=c
            ),
            lambda: dequantize_activations(act_q, act_s),
            dequantize_activations(spec_q, spec_s),
            slice(0, num_pairs),
        ),
        "down": (
            lambda c: expert_down_fp8(
                spec_q, spec_s, q2, s2, offsets, pairs, weights, per_pair, config=c
            ),
            lambda: per_pair,
            down_spec,
            served,
        ),
    }


def gemm_key(gemm: str, shape: Shape, fp8: bool) -> str:
    """The table key of ``gemm`` (``up``: N = I, K = H, gated; ``down``: N = H, K = I)."""
    n, k = (
        (shape.intermediate, shape.hidden) if gemm == "up" else (shape.hidden, shape.intermediate)
    )
    return shape_key(gemm, shape.num_local, n, k, gated=True, fp8=fp8)


def tune_point(
    shape: Shape,
    tokens: int,
    device: torch.device,
    iters: int,
    fp8: bool,
    shipped: dict[str, dict[Fraction, TileConfig]],
) -> dict:
    """Best config of each GEMM for (shape, T), with every candidate's time; the entry
    ``shipped`` (this GPU's table before the run) holds for the point is timed too (a run never
    writes a slower one)."""
    runs = _runs(shape, tokens, device, fp8)
    bucket = rows_bucket(tokens * shape.top_k, shape.num_local)
    result: dict = {"shape": shape.name, "tokens": tokens, "bucket": str(bucket), "fp8": fp8}
    for gemm, (run, got, want, rows) in runs.items():
        timings = {}
        tried = fp8_candidates(bucket, gemm) if fp8 else candidates(bucket)
        key = gemm_key(gemm, shape, fp8)
        entry = shipped.get(key, {}).get(bucket)
        if entry is not None and entry not in tried:
            tried.append(entry)
        for config in tried:
            try:
                timings[config] = device_ms(lambda c=config, run=run: run(c), iters)
            except Exception as error:  # out of shared memory / registers: not a candidate
                print(f"  {gemm} {config}: {type(error).__name__}", file=sys.stderr)
        best = min(timings, key=timings.__getitem__)
        run(best)
        diff = got()[rows].float() - want[rows].float()
        error = diff.norm() / want[rows].float().norm()
        if not error < 2e-2:
            raise AssertionError(f"{shape.name} T={tokens} {gemm} {best}: relative error {error}")
        result[gemm] = {
            "key": key,
            "best": best.to_json(),
            "best_ms": timings[best],
            "rel_error": float(error),
            "tried": [[c.to_json(), ms] for c, ms in sorted(timings.items(), key=lambda t: t[1])],
        }
        label = "fp8 " if fp8 else ""
        print(
            f"{shape.name} T={tokens} bucket={bucket} {label}{gemm}: {timings[best]:.4f} ms {best}"
        )
    return result


def shared_best(points: list[dict]) -> dict:
    """The config for token counts that share one table entry (the same GEMM, shape and
    rows-per-expert bucket, e.g. Qwen3's T 1 and T 8): the lowest sum over the points of its
    time over that point's best, among the configs every point timed; one point: its best."""
    ratios: dict[str, list[float]] = {}
    for point in points:
        fastest = point["best_ms"]
        for config, ms in point["tried"]:
            ratios.setdefault(json.dumps(config, sort_keys=True), []).append(ms / fastest)
    common = {config: sum(r) for config, r in ratios.items() if len(r) == len(points)}
    return json.loads(min(common, key=common.__getitem__))


def merge(document: dict, device_name: str, results: list[dict]) -> dict:
    """The table with this run's winners written under ``device_name``."""
    devices = document.setdefault("devices", {})
    entries = devices.setdefault(device_name, {})
    sharing: dict[tuple[str, str], list[dict]] = {}
    for point in results:
        for gemm in ("up", "down"):
            sharing.setdefault((point[gemm]["key"], str(point["bucket"])), []).append(point[gemm])
    for (key, bucket), points in sharing.items():
        entries.setdefault(key, {})[bucket] = shared_best(points)
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench.tune_experts", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--iters", type=int, default=10, help="timed runs per candidate")
    parser.add_argument(
        "--quantization",
        choices=("none", "fp8_block"),
        default="none",
        help="tune the bf16 GEMMs (none) or the fp8 block-scale GEMMs",
    )
    parser.add_argument("--table", type=Path, default=table_path(), help="the table to update")
    parser.add_argument("--json", type=Path, help="also write every candidate's time here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: tune_experts needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    device_name = torch.cuda.get_device_name(device)
    document = json.loads(args.table.read_text()) if args.table.exists() else {}
    shipped = parse_table(document).get(device_name, {})  # before this run merges its own
    document["command"] = "python -m ep_runtime.bench.tune_experts [--quantization fp8_block]"
    results = []
    for name in args.shapes:
        for tokens in args.tokens:
            fp8 = args.quantization == "fp8_block"
            results.append(tune_point(SHAPES[name], tokens, device, args.iters, fp8, shipped))
            merge(document, device_name, results)  # written as it goes: a cut run keeps it
            args.table.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": device_name, "results": results}, indent=1))
    print(f"wrote {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
