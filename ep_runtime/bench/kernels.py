"""The data path's Triton kernels against their torch twins at model shapes, on one CUDA GPU:

    python -m ep_runtime.bench.kernels --json kernels.json

1. Per op, at the shapes of ``SHAPES`` (DeepSeek-V3 EP8, one rank's shard of 32 experts: T 4096
   or 128, H 7168, I 2048, K 8; Qwen3-30B-A3B on one rank: 128 experts, H 2048, I 768, K 8): the
   Triton op's result against its twin's (``OpCase.matches``, the comparison that
   tests/kernels/test_kernels_at_model_shapes.py asserts), the time of each
   (``bench.timing.time_ms``)
   and the op's bytes moved as GB/s next to the device's copy rate (a 2 GiB device-to-device
   copy, read + write, measured in the same run).
2. The kernels and copies one ``EPMoE`` forward launches at world size 1 (``bench.timing
   .device_activity``), both layouts and modes, on the Triton ops and on the twins.

Everything goes to stdout and, as JSON, to ``--json``. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from ep_runtime.bench.layer import Point, build_layer, inputs
from ep_runtime.bench.timing import copy_rate_bytes_per_ms, device_activity, time_ms
from ep_runtime.kernels import TORCH_OPS, TRITON_OPS
from ep_runtime.kernels.layout import ChunkLayout, RowFormat, header_rows_for
from ep_runtime.kernels.ops import KERNELS_ENV
from ep_runtime.kernels.wire import HEADER_INTS, Field, HeaderFields, new_control

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int  # global
    world: int  # ranks the experts are spread over (this rank is rank 0)
    tokens: int  # per rank
    hidden: int
    intermediate: int
    top_k: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.world


SHAPES = [
    Shape("deepseek_v3_ep8_prefill", 256, 8, 4096, 7168, 2048, 8),
    Shape("deepseek_v3_ep8_decode", 256, 8, 128, 7168, 2048, 8),
    Shape("qwen3_30b_a3b_prefill", 128, 1, 4096, 2048, 768, 8),
    Shape("qwen3_30b_a3b_decode", 128, 1, 128, 2048, 768, 8),
]


@dataclass(frozen=True)
class OpCase:
    """One op on one shape: both implementations, ready to run, and how to compare them."""

    op: str
    variant: str
    triton: Callable[[], object]
    torch: Callable[[], object]
    matches: Callable[[], bool]  # runs both and compares their results
    moved_bytes: int  # bytes read + written; 0 for latency-bound ops


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, a NaN matching any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return bool(((a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())).all())
    return bool((a == b).all())


def within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int) -> bool:
    """bf16: |a - b| ≤ ulps · 2⁻⁷ · |b| + tiny, NaN where b is NaN."""
    a32, b32 = a.float(), b.float()
    bound = ulps * 2.0**-7 * b32.abs() + torch.finfo(BF16).tiny
    return bool(((b32.isnan() & a32.isnan()) | ((a32 - b32).abs() <= bound)).all())


def same_fields(a: object, b: object, fields: tuple[str, ...]) -> bool:
    return all(same_bits(getattr(a, f), getattr(b, f)) for f in fields)


Pair = tuple[Callable[[], object], Callable[[], object]]  # (Triton op, torch twin), ready to run


def results_equal(run: Pair, fields: tuple[str, ...] | None = None) -> Callable[[], bool]:
    """A ``matches``: both results bitwise equal (whole tensors, or these fields of each)."""

    def matches() -> bool:
        got, want = run[0](), run[1]()
        return same_fields(got, want, fields) if fields else same_bits(got, want)

    return matches


def buffers_equal(run: Pair, buffers: list[torch.Tensor]) -> Callable[[], bool]:
    """A ``matches`` for ops that write into an output: each writes its own, then compare."""

    def matches() -> bool:
        run[0]()
        run[1]()
        return same_bits(*buffers)

    return matches


def random_ids(tokens: int, shape: Shape, seed: int, device: torch.device) -> torch.Tensor:
    """``[T, K]`` int64 distinct global ids per token (uniform routing)."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, shape.num_experts, generator=g, device=device)
    return scores.topk(shape.top_k, dim=1).indices


def route(ops, ids: torch.Tensor, shape: Shape, drop: bool):
    header = torch.empty(shape.world, HEADER_INTS, dtype=torch.int32, device=ids.device)
    return ops.route_tokens(
        ids,
        num_experts=shape.num_experts,
        experts_per_rank=shape.num_local,
        world_size=shape.world,
        drop_invalid=drop,
        control=new_control(ids.device),
        fields=HeaderFields(0, 0x1234, 0, 1, shape.top_k, 1),
        header_out=header,
    )


def received_rows(shape: Shape, row_format: RowFormat, device: torch.device) -> torch.Tensor:
    """The rows rank 0 receives: every peer's tokens with an expert in [0, L), packed."""
    peers = [random_ids(shape.tokens, shape, 100 + peer, device) for peer in range(shape.world)]
    ids = torch.cat(peers)
    ids = ids[((ids >= 0) & (ids < shape.num_local)).any(dim=1)]
    rows = torch.zeros(ids.size(0), row_format.row_bytes, dtype=torch.uint8, device=device)
    row_format.hidden(rows).copy_(torch.randn(ids.size(0), shape.hidden, device=device))
    row_format.ids(rows, shape.top_k).copy_(ids)
    row_format.weights(rows, shape.top_k).copy_(torch.rand(ids.shape, device=device))
    return rows


def op_cases(shape: Shape, device: torch.device) -> list[OpCase]:
    """Every data-path op at ``shape``, its inputs built on ``device`` (CUDA)."""
    impls = (TRITON_OPS, TORCH_OPS)
    elem, (H, T, K) = BF16.itemsize, (shape.hidden, shape.tokens, shape.top_k)
    cases: list[OpCase] = []

    def add(op: str, variant: str, run: Pair, matches: Callable[[], bool], moved: int) -> None:
        cases.append(OpCase(op, variant, run[0], run[1], matches, moved))

    ids = random_ids(T, shape, 1, device)
    x = torch.randn(T, H, device=device).to(BF16)
    weights = torch.rand(T, K, device=device)
    for drop in (False, True):
        run = tuple(partial(route, ops, ids, shape, drop) for ops in impls)
        fields = ("ids", "dest_slot", "token_of", "header")
        add("route_tokens", f"drop={drop}", run, results_equal(run, fields), 0)
    plan = route(TORCH_OPS, ids, shape, False)
    counts = plan.header[:, Field.NUM_ROWS]
    rows_per_rank = counts.tolist()

    row_format = RowFormat(H, BF16, K)
    for capacity in (None, T):
        chunks = ChunkLayout(header_rows_for(H, BF16), capacity)
        total = chunks.total_rows(rows_per_rank)
        sends = [torch.zeros(total, row_format.row_bytes, dtype=torch.uint8, device=device)]
        sends.append(torch.zeros_like(sends[0]))
        run = tuple(
            partial(ops.pack_rows, x, weights, plan, send, row_format, chunks)
            for ops, send in zip(impls, sends, strict=True)
        )
        moved = sum(rows_per_rank) * H * elem + total * row_format.row_bytes
        variant = "exact" if capacity is None else "capacity"
        add("pack_rows", variant, run, buffers_equal(run, sends), moved)

    # the receiving side: rank 0's rows from every peer
    recv = received_rows(shape, row_format, device)
    hidden, recv_ids = row_format.hidden(recv), row_format.ids(recv, K)
    recv_weights = row_format.weights(recv, K)
    num_recv = recv.size(0)
    local = dict(local_offset=0, num_local=shape.num_local)
    served = int(((recv_ids >= 0) & (recv_ids < shape.num_local)).sum())
    run = tuple(partial(ops.local_ids, recv_ids, **local) for ops in impls)
    add("local_ids", "", run, results_equal(run), num_recv * K * 8)

    capacity_rows = shape.world * T * min(K, shape.num_local)
    for variant, num_rows in (("exact", served), ("capacity", capacity_rows)):
        run = tuple(
            partial(ops.group_rows, hidden, recv_ids, recv_weights, num_rows=num_rows, **local)
            for ops in impls
        )

        def grouped_equal(run: Pair = run) -> bool:
            """Every field, and the hidden rows up to the last valid one (padding undefined)."""
            got, want = run[0](), run[1]()
            valid = int(want.offsets[-1])
            fields = ("positions", "offsets", "ids", "weights")
            return same_fields(got, want, fields) and same_bits(
                got.hidden[:valid], want.hidden[:valid]
            )

        moved = 2 * served * H * elem + num_recv * K * 8 + num_rows * 8
        add("group_rows", f"{variant} N={num_rows}", run, grouped_equal, moved)

    grouped = TORCH_OPS.group_rows(hidden, recv_ids, recv_weights, num_rows=served, **local)
    num_grouped = grouped.hidden.size(0)
    h = torch.randn(num_grouped, 2 * shape.intermediate, device=device).to(BF16)  # [N, 2I]
    run = tuple(partial(ops.weighted_activation, h, grouped.weights, gated=True) for ops in impls)
    moved = num_grouped * 3 * shape.intermediate * elem + num_grouped * 4
    add("weighted_activation", "silu", run, lambda: within_ulps(run[0](), run[1](), 2), moved)

    # pre-reduce: grouped results [N, H] -> one row per received row [R, H]
    results_rows = torch.randn(num_grouped, H, device=device).to(BF16)
    back = [torch.empty(num_recv, H, dtype=BF16, device=device) for _ in impls]
    run = tuple(
        partial(ops.sum_rows, results_rows, grouped.positions, out)
        for ops, out in zip(impls, back, strict=True)
    )
    moved = served * H * elem + num_recv * H * elem + num_recv * K * 4
    add("sum_rows", "pre-reduce", run, buffers_equal(run, back), moved)

    # combine: every rank's results for this rank's tokens [S, H] (chunks) -> [T, H]
    for capacity in (None, T):
        chunks = ChunkLayout(header_rows_for(H, BF16), capacity)
        returned = torch.randn(chunks.total_rows(rows_per_rank), H, device=device).to(BF16)
        outs = [torch.empty(T, H, dtype=BF16, device=device) for _ in impls]
        run = tuple(
            partial(ops.sum_rows, returned, plan.dest_slot, out, chunk_counts=counts, chunks=chunks)
            for ops, out in zip(impls, outs, strict=True)
        )
        moved = sum(rows_per_rank) * H * elem + T * H * elem + T * shape.world * 4
        variant = "combine " + ("exact" if capacity is None else "capacity")
        add("sum_rows", variant, run, buffers_equal(run, outs), moved)

    # headers (latency)
    received = plan.header.clone()
    controls = [new_control(device) for _ in impls]
    header_args = dict(rank=0, phase=1, top_k=K, mismatch_status=4)
    run = tuple(
        partial(ops.record_headers, received, control, **header_args)
        for ops, control in zip(impls, controls, strict=True)
    )
    add("record_headers", "", run, buffers_equal(run, controls), 0)
    chunks = ChunkLayout(header_rows_for(H, BF16), None)
    status = torch.arange(HEADER_INTS, dtype=torch.int32, device=device)
    total = chunks.total_rows(rows_per_rank)
    buffers = [torch.zeros(total, H, dtype=BF16, device=device) for _ in impls]
    run = tuple(
        partial(ops.write_chunk_headers, buffer, status, counts, chunks)
        for ops, buffer in zip(impls, buffers, strict=True)
    )
    add("write_chunk_headers", "", run, buffers_equal(run, buffers), 0)
    run = tuple(partial(ops.read_chunk_headers, buffers[0], counts, chunks) for ops in impls)
    add("read_chunk_headers", "", run, results_equal(run), 0)
    return cases


@dataclass(frozen=True)
class Timed:
    shape: str
    op: str
    variant: str
    ok: bool
    triton_ms: float
    torch_ms: float
    moved_bytes: int
    gbps: float  # moved bytes over the Triton op's time (0: latency-bound)
    of_copy: float  # gbps over the device's copy rate

    def line(self) -> str:
        bandwidth = ""
        if self.moved_bytes:
            bandwidth = f"{self.gbps:8.0f} GB/s ({100 * self.of_copy:5.1f}% of copy)"
        check = "ok" if self.ok else "MISMATCH"
        return (
            f"{self.shape:26s} {self.op:20s} {self.variant:18s} {check:8s} "
            f"triton {1000 * self.triton_ms:9.1f} us  torch {1000 * self.torch_ms:9.1f} us  "
            f"{bandwidth}"
        )


def time_case(shape: Shape, case: OpCase, copy_bytes_per_ms: float) -> Timed:
    triton_ms = time_ms(case.triton)
    gbps = case.moved_bytes / triton_ms / 1e6
    return Timed(
        shape.name,
        case.op,
        case.variant,
        case.matches(),
        triton_ms,
        time_ms(case.torch),
        case.moved_bytes,
        gbps,
        gbps / (copy_bytes_per_ms / 1e6),
    )


def kernels_per_forward(layout: str, mode: str, kernels: str, device: torch.device) -> dict:
    """Kernels and copies of one EPMoE forward at world size 1 (after a warm-up forward), on
    the Triton ops or (``kernels="torch"``) on the twins."""
    point = Point("per-forward", 32, 512, 2048, 768, 8, mode, layout)
    os.environ[KERNELS_ENV] = "torch" if kernels == "torch" else "auto"
    try:
        w13, w2, x, ids, weights = inputs(point, device)
        layer = build_layer(point, device)
        try:
            layer.load_weights(w13, w2)
            layer(x, ids, weights)
            torch.cuda.synchronize()
            activity = device_activity(lambda: layer(x, ids, weights))
        finally:
            layer.close()
    finally:
        os.environ.pop(KERNELS_ENV, None)
    return {
        "kernels": activity.num_kernels,
        "memcpy_memset": activity.num_copies,
        "names": activity.kernels,
        "copies": activity.copies,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench.kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    names = [shape.name for shape in SHAPES]
    parser.add_argument("--shapes", nargs="+", choices=names, default=names)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: python -m ep_runtime.bench.kernels needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    rate = copy_rate_bytes_per_ms(device)
    report: dict = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_tb_per_s": rate / 1e9,
    }
    print(f"== per-op results and timings; device copy (2 GiB, read + write) {rate / 1e9:.2f} TB/s")
    timed = []
    for shape in (s for s in SHAPES if s.name in args.shapes):
        for case in op_cases(shape, device):
            timed.append(time_case(shape, case, rate))
            print(timed[-1].line(), flush=True)
    report["ops"] = [asdict(t) for t in timed]
    print("\n== device activity per layer forward (world size 1)", flush=True)
    report["per_forward"] = {}
    for layout in ("expanded", "standard"):
        for mode in ("exact", "capacity"):
            for kernels in ("triton", "torch"):
                key = f"{layout}/{mode}/{kernels}"
                counted = kernels_per_forward(layout, mode, kernels, device)
                report["per_forward"][key] = counted
                print(
                    f"{key:28s} kernels {counted['kernels']:4d}  memcpy/memset "
                    f"{counted['memcpy_memset']:3d}  {counted['names']}",
                    flush=True,
                )
    report["passed"] = all(t.ok for t in timed)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"\n{'PASSED' if report['passed'] else 'FAILED'}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
