"""Where a layer forward spends host time: cProfile over forwards of one point of
``python -m ep_runtime.bench`` (one CUDA GPU), and the host time per forward.

    python -m ep_runtime.bench.profile_forward --point qwen3-30b-a3b-decode --forwards 50
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from ep_runtime.bench.layer import POINTS, build_layer, inputs


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ep_runtime.bench.profile_forward", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--point", choices=sorted(POINTS), default="qwen3-30b-a3b-decode")
    parser.add_argument("--forwards", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    point, device = POINTS[args.point], torch.device("cuda", torch.cuda.current_device())
    w13, w2, x, ids, weights = inputs(point, device)
    layer = build_layer(point, device)
    layer.load_weights(w13, w2)
    for _ in range(5):
        layer(x, ids, weights)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.forwards):
        layer(x, ids, weights)
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    done = time.perf_counter() - start
    print(
        f"{args.point}: host {issued / args.forwards * 1e3:.3f} ms/forward to issue, "
        f"{done / args.forwards * 1e3:.3f} ms/forward to finish"
    )
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.forwards):
        layer(x, ids, weights)
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile).strip_dirs()
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)
    layer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
