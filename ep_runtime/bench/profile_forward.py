"""Where a layer forward spends host time: cProfile over forwards of one point of
``python -m ep_runtime.bench`` (or a tiny point, which CPU runs in no time), and the host time
per forward.

    python -m ep_runtime.bench.profile_forward --point qwen3-30b-a3b-decode --forwards 50
    python -m ep_runtime.bench.profile_forward --device cpu --point tiny-decode --forwards 500
    python -m ep_runtime.bench.profile_forward --experts triton --launch-split --no-profile

``--launch-split`` (CUDA) splits the host time to issue a forward, all in one run: with our
kernels launched through ``LaunchedKernel``'s fast path, through Triton's ``JITFunction.run``
(the fast path off), the time spent inside the launches, and with every launch a no-op (the
layer's own Python and torch calls alone; the device does nothing, so this is host only).

Exact-mode points run with ``device_checks=True`` (as ``experts_sweep`` and the transformers
blocks do), so no host read of the ids' verdict ends a forward. On CUDA, "to issue" is the
host's time per forward (forwards issued back to back, no sync), "to finish" includes the
device. On CPU (fp32 by default: CPU bf16 GEMMs are slow) the two are the same: at the tiny
points the arithmetic is a few microseconds, so the time per forward is the layer's Python and
dispatch overhead; on a shared machine the process's CPU time (also printed) is steadier than
the wall time. Times are the best of ``--repeats`` batches of
``--forwards`` (noise only ever adds). Set ``OMP_NUM_THREADS=1`` on CPU to keep torch's
thread pool out of the figure.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from ep_runtime.bench.layer import POINTS, Point, add_layer_flags, build_layer, inputs
from ep_runtime.bench.timing import sync
from ep_runtime.kernels import triton_common

# small shapes for finding Python overhead on any machine (world size 1, grouped_mm)
TINY_POINTS = {
    point.name: point
    for point in (
        Point("tiny-decode", 8, 16, 64, 32, 2, "capacity", "expanded"),
        Point("tiny-prefill", 8, 64, 64, 32, 2, "exact", "expanded"),
    )
}


def time_forwards(
    layer, x, ids, weights, forwards: int, repeats: int, device
) -> tuple[float, float, float]:
    """µs per forward, each the best over ``repeats`` batches of ``forwards`` issued back to
    back: (to issue, to finish, of this process's CPU time to issue)."""
    issued = done = cpu = float("inf")
    for _ in range(repeats):
        sync(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(forwards):
            layer(x, ids, weights)
        issued = min(issued, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
        sync(device)
        done = min(done, time.perf_counter() - start)
    return issued / forwards * 1e6, done / forwards * 1e6, cpu / forwards * 1e6


def launch_split(layer, x, ids, weights, forwards: int, repeats: int, device) -> None:
    """Host µs per forward: fast launches, Triton's launcher, time inside launches, no-ops."""
    launched = triton_common.LaunchedKernel
    original = launched.launch
    inside = [0.0, 0]

    def timed(self, grid, args, kwargs):
        start = time.perf_counter()
        result = original(self, grid, args, kwargs)
        inside[0] += time.perf_counter() - start
        inside[1] += 1
        return result

    rows = []
    fast_before = triton_common._FAST_LAUNCH
    try:
        for label, fast, patch in (
            ("fast launch", True, None),
            ("Triton's JITFunction.run", False, None),
            ("fast launch, timed inside", True, timed),
            ("every launch a no-op", True, lambda self, grid, args, kwargs: None),
        ):
            triton_common._FAST_LAUNCH = fast
            launched.launch = patch or original
            inside[:] = [0.0, 0]
            host = time_forwards(layer, x, ids, weights, forwards, repeats, device)[0]
            calls = inside[1] // (forwards * repeats) if inside[1] else 0
            within = inside[0] / (forwards * repeats) * 1e6 if inside[1] else None
            rows.append((label, host, calls, within))
    finally:
        triton_common._FAST_LAUNCH = fast_before
        launched.launch = original
    for label, host, calls, within in rows:
        extra = f", {within:.1f} us inside {calls} launches" if within is not None else ""
        print(f"  {label:28s} {host:7.1f} us/forward to issue{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench.profile_forward", description=__doc__.splitlines()[0]
    )
    points = {**POINTS, **TINY_POINTS}
    parser.add_argument("--point", choices=sorted(points), default="qwen3-30b-a3b-decode")
    parser.add_argument("--mode", choices=("exact", "capacity"), help="override the point's mode")
    parser.add_argument("--layout", choices=("standard", "expanded"), help="override its layout")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--forwards", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--experts", default="grouped_mm", help="the experts backend")
    parser.add_argument("--no-profile", action="store_true", help="only the time per forward")
    add_layer_flags(parser)
    parser.add_argument(
        "--launch-split",
        action="store_true",
        help="CUDA, capacity mode: host time with fast launches, Triton's, and no-op launches",
    )
    args = parser.parse_args(argv)
    point = points[args.point]
    overrides = {"mode": args.mode, "layout": args.layout}
    point = Point(**{**point.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if use_cuda else torch.float32
    )
    if args.launch_split and (
        not use_cuda or point.mode != "capacity" or args.forward_graphs == "on"
    ):
        parser.error(  # no-op launches leave exact mode's sizes unwritten: it would read garbage
            "--launch-split needs CUDA, capacity mode and --forward-graphs off (it splits the "
            f"launches), given {device.type}, {point.mode}, --forward-graphs {args.forward_graphs}"
        )
    w13, w2, x, ids, weights = inputs(point, device, dtype=dtype)
    layer = build_layer(
        point,
        device,
        dtype=dtype,
        experts=args.experts,
        device_checks=point.mode == "exact",  # no host read ends an exact forward
        forward_graphs=args.forward_graphs == "on",
        dispatcher=args.dispatcher,
    )
    layer.load_weights(w13, w2)
    for _ in range(5):
        layer(x, ids, weights)
    issued, done, cpu = time_forwards(layer, x, ids, weights, args.forwards, args.repeats, device)
    print(
        f"{point.name} ({point.mode}, {point.layout}, {args.dispatcher}, {args.experts}, "
        f"T={point.tokens}, {dtype}, "
        f"{device.type}, layer graphs {'on' if layer.graphs else 'off'}): host {issued:.1f} "
        f"us/forward to issue, {done:.1f} us/forward to "
        f"finish, {cpu:.1f} us/forward of this process's CPU time to issue"
    )
    if args.launch_split:
        launch_split(layer, x, ids, weights, args.forwards, args.repeats, device)
    if not args.no_profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.forwards):
            layer(x, ids, weights)
        profile.disable()
        sync(device)
        stats = pstats.Stats(profile).strip_dirs()
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumtime").print_stats(args.top)
    layer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
