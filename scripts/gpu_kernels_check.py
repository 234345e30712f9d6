"""GPU check of the Triton data-path kernels (``ep_runtime/kernels/``, a file per op), one command:

    python scripts/gpu_kernels_check.py --out kernels.json

1. ``tests/test_kernels.py`` on CUDA (pytest, compiled kernels).
2. Per op, at the issue's shapes (DeepSeek-V3 EP8 shard prefill: 256 experts over 8 ranks = 32
   local, T 4096, H 7168, I 2048, K 8; Qwen3-30B-A3B on one rank: 128 experts, T 4096, H 2048,
   I 768, K 8; and decode, T 128): the result against the torch twin at that size, then the
   time of the Triton op and of its twin, and the op's bytes moved as GB/s next to a
   device-to-device copy of the same bytes timed in the same run.
3. Kernels per layer forward (torch.profiler), EPMoE at world size 1, both layouts and modes,
   on the Triton ops and on the torch twins.

Everything goes to stdout and, as JSON, to ``--out``. Exit status 1 on any failed test or
mismatch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ep_runtime import EPMoE, MoEConfig  # noqa: E402
from ep_runtime.kernels import TORCH_OPS as torch_ops  # noqa: E402
from ep_runtime.kernels import TRITON_OPS as triton_ops  # noqa: E402
from ep_runtime.kernels.layout import ChunkLayout, RowFormat, header_rows_for  # noqa: E402
from ep_runtime.kernels.wire import HEADER_INTS, Field, HeaderFields, new_control  # noqa: E402

BF16 = torch.bfloat16
DEVICE = torch.device("cuda")


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


# --------------------------------------------------------------------------- comparisons
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
    ok = (b32.isnan() & a32.isnan()) | ((a32 - b32).abs() <= bound)
    return bool(ok.all())


# --------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


class CopyReference:
    """Device-to-device copy of ``n`` bytes (moves 2n: read + write), timed once per size."""

    def __init__(self) -> None:
        self.cache: dict[int, float] = {}

    def gbps(self, moved_bytes: int) -> float:
        half = max(moved_bytes // 2, 1)
        if half not in self.cache:
            src = torch.empty(half, dtype=torch.uint8, device=DEVICE)
            dst = torch.empty_like(src)
            self.cache[half] = 2 * half / time_ms(lambda: dst.copy_(src)) / 1e6
        return self.cache[half]


# --------------------------------------------------------------------------- inputs
def random_ids(tokens: int, shape: Shape, seed: int) -> torch.Tensor:
    """``[T, K]`` int64 distinct global ids per token (uniform routing)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(tokens, shape.num_experts, generator=g, device=DEVICE)
    return scores.topk(shape.top_k, dim=1).indices


def fields(shape: Shape) -> HeaderFields:
    return HeaderFields(0, 0x1234, 0, 1, shape.top_k, 1)


def route(ops, ids: torch.Tensor, shape: Shape, drop: bool):
    control = new_control(DEVICE)
    header = torch.empty(shape.world, HEADER_INTS, dtype=torch.int32, device=DEVICE)
    return ops.route_tokens(
        ids,
        num_experts=shape.num_experts,
        experts_per_rank=shape.num_local,
        world_size=shape.world,
        drop_invalid=drop,
        control=control,
        fields=fields(shape),
        header_out=header,
    )


def received_rows(shape: Shape, row_format: RowFormat) -> torch.Tensor:
    """The rows rank 0 receives: every peer's tokens with an expert in [0, L), packed."""
    peers = [random_ids(shape.tokens, shape, seed=100 + peer) for peer in range(shape.world)]
    ids = torch.cat(peers)
    ids = ids[((ids >= 0) & (ids < shape.num_local)).any(dim=1)]
    rows = torch.zeros(ids.size(0), row_format.row_bytes, dtype=torch.uint8, device=DEVICE)
    row_format.hidden(rows).copy_(torch.randn(ids.size(0), shape.hidden, device=DEVICE))
    row_format.ids(rows, shape.top_k).copy_(ids)
    row_format.weights(rows, shape.top_k).copy_(torch.rand(ids.shape, device=DEVICE))
    return rows


# --------------------------------------------------------------------------- per-op checks
@dataclass
class Result:
    shape: str
    op: str
    variant: str
    ok: bool
    triton_ms: float
    torch_ms: float
    moved_bytes: int
    copy_gbps: float

    @property
    def gbps(self) -> float:
        return self.moved_bytes / self.triton_ms / 1e6 if self.moved_bytes else 0.0

    def line(self) -> str:
        check = "ok" if self.ok else "MISMATCH"
        bandwidth = (
            f"{self.gbps:8.0f} GB/s ({100 * self.gbps / self.copy_gbps:5.1f}% of copy)"
            if self.moved_bytes
            else " " * 32
        )
        return (
            f"{self.shape:26s} {self.op:20s} {self.variant:18s} {check:8s} "
            f"triton {1000 * self.triton_ms:9.1f} us  torch {1000 * self.torch_ms:9.1f} us  "
            f"{bandwidth}"
        )


def bench_shape(shape: Shape, copy: CopyReference) -> list[Result]:
    results: list[Result] = []
    elem = BF16.itemsize
    H, T, K = shape.hidden, shape.tokens, shape.top_k

    def record(op, variant, ok, run_triton, run_torch, moved):
        results.append(
            Result(
                shape.name,
                op,
                variant,
                ok,
                time_ms(run_triton),
                time_ms(run_torch),
                moved,
                copy.gbps(moved) if moved else 0.0,
            )
        )
        print(results[-1].line(), flush=True)

    ids = random_ids(T, shape, seed=1)
    x = torch.randn(T, H, device=DEVICE).to(BF16)
    weights = torch.rand(T, K, device=DEVICE)

    # route_tokens
    for drop in (False, True):
        got, want = route(triton_ops, ids, shape, drop), route(torch_ops, ids, shape, drop)
        ok = all(
            same_bits(getattr(got, f), getattr(want, f))
            for f in ("ids", "dest_slot", "token_of", "header")
        )
        record(
            "route_tokens",
            f"drop={drop}",
            ok,
            lambda drop=drop: route(triton_ops, ids, shape, drop),
            lambda drop=drop: route(torch_ops, ids, shape, drop),
            0,
        )
    plan = route(torch_ops, ids, shape, False)
    rows_per_rank = plan.header[:, Field.NUM_ROWS].tolist()

    # pack_rows, both chunk layouts
    row_format = RowFormat(H, BF16, K)
    for capacity in (None, T):
        chunks = ChunkLayout(header_rows_for(H, BF16), capacity)
        total = chunks.total_rows(rows_per_rank)
        sends = [
            torch.zeros(total, row_format.row_bytes, dtype=torch.uint8, device=DEVICE)
            for _ in range(2)
        ]
        triton_ops.pack_rows(x, weights, plan, sends[0], row_format, chunks)
        torch_ops.pack_rows(x, weights, plan, sends[1], row_format, chunks)
        ok = same_bits(sends[0], sends[1])
        moved = sum(rows_per_rank) * H * elem + total * row_format.row_bytes
        record(
            "pack_rows",
            "exact" if capacity is None else "capacity",
            ok,
            lambda c=chunks, s=sends[0]: triton_ops.pack_rows(x, weights, plan, s, row_format, c),
            lambda c=chunks, s=sends[1]: torch_ops.pack_rows(x, weights, plan, s, row_format, c),
            moved,
        )

    # the receiving side: rank 0's rows from every peer
    recv = received_rows(shape, row_format)
    hidden = row_format.hidden(recv)
    recv_ids = row_format.ids(recv, K)
    recv_weights = row_format.weights(recv, K)
    num_recv = recv.size(0)
    local = dict(local_offset=0, num_local=shape.num_local)
    served = int(((recv_ids >= 0) & (recv_ids < shape.num_local)).sum())

    got = triton_ops.local_ids(recv_ids, **local)
    ok = same_bits(got, torch_ops.local_ids(recv_ids, **local))
    record(
        "local_ids",
        "",
        ok,
        lambda: triton_ops.local_ids(recv_ids, **local),
        lambda: torch_ops.local_ids(recv_ids, **local),
        num_recv * K * 8,
    )

    grouped = None
    for variant, num_rows in (
        ("exact", served),
        ("capacity", shape.world * T * min(K, shape.num_local)),
    ):
        args = (hidden, recv_ids, recv_weights)
        got = triton_ops.group_rows(*args, num_rows=num_rows, **local)
        want = torch_ops.group_rows(*args, num_rows=num_rows, **local)
        valid = int(want.offsets[-1])
        ok = all(
            same_bits(getattr(got, f), getattr(want, f))
            for f in ("positions", "offsets", "ids", "weights")
        ) and same_bits(got.hidden[:valid], want.hidden[:valid])
        grouped = grouped or want
        record(
            "group_rows",
            f"{variant} N={num_rows}",
            ok,
            lambda n=num_rows, a=args: triton_ops.group_rows(*a, num_rows=n, **local),
            lambda n=num_rows, a=args: torch_ops.group_rows(*a, num_rows=n, **local),
            2 * served * H * elem + num_recv * K * 8 + num_rows * 8,
        )
    assert grouped is not None

    # weighted activation on [N, 2I]
    num_grouped = grouped.hidden.size(0)
    h = torch.randn(num_grouped, 2 * shape.intermediate, device=DEVICE).to(BF16)
    w = grouped.weights
    ok = within_ulps(
        triton_ops.weighted_activation(h, w, gated=True),
        torch_ops.weighted_activation(h, w, gated=True),
        2,
    )
    record(
        "weighted_activation",
        "silu",
        ok,
        lambda: triton_ops.weighted_activation(h, w, gated=True),
        lambda: torch_ops.weighted_activation(h, w, gated=True),
        num_grouped * 3 * shape.intermediate * elem + num_grouped * 4,
    )

    # pre-reduce: grouped results [N, H] → one row per received row [R, H]
    results_rows = torch.randn(num_grouped, H, device=DEVICE).to(BF16)
    back = [torch.empty(num_recv, H, dtype=BF16, device=DEVICE) for _ in range(2)]
    triton_ops.sum_rows(results_rows, grouped.positions, back[0])
    torch_ops.sum_rows(results_rows, grouped.positions, back[1])
    record(
        "sum_rows",
        "pre-reduce",
        same_bits(back[0], back[1]),
        lambda: triton_ops.sum_rows(results_rows, grouped.positions, back[0]),
        lambda: torch_ops.sum_rows(results_rows, grouped.positions, back[1]),
        served * H * elem + num_recv * H * elem + num_recv * K * 4,
    )

    # combine: every rank's results for this rank's tokens [S, H] (chunks) → [T, H]
    counts = plan.header[:, Field.NUM_ROWS]
    for capacity in (None, T):
        chunks = ChunkLayout(header_rows_for(H, BF16), capacity)
        returned = torch.randn(chunks.total_rows(rows_per_rank), H, device=DEVICE).to(BF16)
        outs = [torch.empty(T, H, dtype=BF16, device=DEVICE) for _ in range(2)]
        kwargs = dict(chunk_counts=counts, chunks=chunks)
        triton_ops.sum_rows(returned, plan.dest_slot, outs[0], **kwargs)
        torch_ops.sum_rows(returned, plan.dest_slot, outs[1], **kwargs)
        record(
            "sum_rows",
            "combine " + ("exact" if capacity is None else "capacity"),
            same_bits(outs[0], outs[1]),
            lambda r=returned, o=outs[0], kw=kwargs: triton_ops.sum_rows(
                r, plan.dest_slot, o, **kw
            ),
            lambda r=returned, o=outs[1], kw=kwargs: torch_ops.sum_rows(r, plan.dest_slot, o, **kw),
            sum(rows_per_rank) * H * elem + T * H * elem + T * shape.world * 4,
        )

    # headers (latency)
    received = plan.header.clone()
    controls = [new_control(DEVICE) for _ in range(2)]
    header_args = dict(rank=0, phase=1, top_k=K, mismatch_status=4)
    triton_ops.record_headers(received, controls[0], **header_args)
    torch_ops.record_headers(received, controls[1], **header_args)
    record(
        "record_headers",
        "",
        same_bits(controls[0], controls[1]),
        lambda: triton_ops.record_headers(received, controls[0], **header_args),
        lambda: torch_ops.record_headers(received, controls[1], **header_args),
        0,
    )
    chunks = ChunkLayout(header_rows_for(H, BF16), None)
    status = torch.arange(HEADER_INTS, dtype=torch.int32, device=DEVICE)
    buffers = [
        torch.zeros(chunks.total_rows(rows_per_rank), H, dtype=BF16, device=DEVICE)
        for _ in range(2)
    ]
    triton_ops.write_chunk_headers(buffers[0], status, counts, chunks)
    torch_ops.write_chunk_headers(buffers[1], status, counts, chunks)
    record(
        "write_chunk_headers",
        "",
        same_bits(buffers[0], buffers[1]),
        lambda: triton_ops.write_chunk_headers(buffers[0], status, counts, chunks),
        lambda: torch_ops.write_chunk_headers(buffers[1], status, counts, chunks),
        0,
    )
    record(
        "read_chunk_headers",
        "",
        same_bits(
            triton_ops.read_chunk_headers(buffers[0], counts, chunks),
            torch_ops.read_chunk_headers(buffers[0], counts, chunks),
        ),
        lambda: triton_ops.read_chunk_headers(buffers[0], counts, chunks),
        lambda: torch_ops.read_chunk_headers(buffers[0], counts, chunks),
        0,
    )
    return results


# --------------------------------------------------------------------------- kernels per forward
def kernels_per_forward(layout: str, mode: str, kernels: str) -> dict:
    """Device activity of one EPMoE forward at world size 1 (after a warm-up forward)."""
    os.environ["EP_RUNTIME_KERNELS"] = "torch" if kernels == "torch" else "auto"
    config = MoEConfig(32, 8, 2048, 768, dtype=BF16, max_tokens_per_rank=512)
    layer = EPMoE(
        config,
        dispatcher="torch_a2a",
        experts="grouped_mm",
        layout=layout,
        mode=mode,
        device=DEVICE,
    )
    try:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        layer.load_weights(
            torch.randn(32, 2 * 768, 2048, device=DEVICE, generator=g) / 45,
            torch.randn(32, 2048, 768, device=DEVICE, generator=g) / 28,
        )
        x = torch.randn(512, 2048, device=DEVICE, generator=g).to(BF16)
        ids = torch.rand(512, 32, device=DEVICE, generator=g).topk(8, dim=1).indices
        weights = torch.rand(512, 8, device=DEVICE, generator=g)
        layer(x, ids, weights)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            layer(x, ids, weights)
            torch.cuda.synchronize()
    finally:
        layer.close()
        os.environ.pop("EP_RUNTIME_KERNELS", None)
    with tempfile.TemporaryDirectory() as folder:  # the trace's "cat" says what ran on the GPU
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    launched = [e["name"] for e in events if e.get("cat") == "kernel"]
    copies = [e["name"] for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    return {
        "kernels": len(launched),
        "memcpy_memset": len(copies),
        "names": dict(Counter(launched)),
        "copies": dict(Counter(copies)),
    }


# --------------------------------------------------------------------------- main
def run_tests() -> dict:
    started = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", "8"]  # compiling the kernels' variants dominates: spread it
    command += ["tests/test_kernels.py"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    tail = (done.stdout + done.stderr).strip().splitlines()[-40:]
    print("\n".join(tail), flush=True)
    return {
        "returncode": done.returncode,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": tail[-1] if tail else "",
        "tail": tail,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    report["triton"] = triton.__version__
    failed = False
    if not args.skip_tests:
        print("== tests/test_kernels.py on CUDA", flush=True)
        report["tests"] = run_tests()
        failed |= report["tests"]["returncode"] != 0

    print("\n== per-op results and timings", flush=True)
    copy = CopyReference()
    results: list[Result] = []
    for shape in SHAPES:
        try:
            results += bench_shape(shape, copy)
        except Exception as error:  # report and go on: the other shapes still say something
            print(f"{shape.name}: FAILED: {type(error).__name__}: {error}", flush=True)
            report.setdefault("errors", []).append(f"{shape.name}: {error!r}")
            failed = True
    report["ops"] = [{**r.__dict__, "gbps": r.gbps} for r in results]
    failed |= not all(r.ok for r in results)

    print("\n== device activity per layer forward (world size 1)", flush=True)
    report["per_forward"] = {}
    for layout in ("expanded", "standard"):
        for mode in ("exact", "capacity"):
            for kernels in ("triton", "torch"):
                key = f"{layout}/{mode}/{kernels}"
                try:
                    counted = kernels_per_forward(layout, mode, kernels)
                except Exception as error:
                    print(f"{key}: FAILED: {type(error).__name__}: {error}", flush=True)
                    report.setdefault("errors", []).append(f"{key}: {error!r}")
                    failed = True
                    continue
                report["per_forward"][key] = counted
                print(
                    f"{key:28s} kernels {counted['kernels']:4d}  memcpy/memset "
                    f"{counted['memcpy_memset']:3d}  {counted['names']}",
                    flush=True,
                )
    report["passed"] = not failed
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{'PASSED' if not failed else 'FAILED'}; report in {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
