"""One rank of a group in which one rank dies, run as its own script (``python -m``), as a user's
script would be: an uncaught exception goes through ``sys.excepthook`` and ends the process.

The victim dies before or inside a forward (an uncaught exception, or SIGKILL); every other rank
runs the forward, prints one JSON line (how its forward ended and how long it took) and tears
down as an application should (``destroy_process_group``). ``dying_forward`` is that rank's
work once its group is up; a SIGKILL needs no script around it, so tests run those scenarios in
a pool's rank processes (``RankPool.run_with_a_death``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from ep_runtime.launch.network import apply_interface_defaults
from ep_runtime.launch.rendezvous import LOOPBACK, join_store
from tests.multigpu.rank_inputs import CaseSpec, build_layer, make_inputs

SCENARIOS = ("raise_before", "raise_inside", "kill_before", "kill_inside")


def die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("the application crashed")


def dying_forward(victim: int, scenario: str, mode: str, layout: str) -> dict | None:
    """A forward that works, then one in which ``victim`` dies as ``scenario`` says; every other
    rank's reaction (how its forward ended, how long it took) after closing its layer; ``None``
    on a victim that did not die."""
    spec = CaseSpec(experts="grouped_mm", mode=mode, layout=layout, num_experts=6, tokens=(5,) * 4)
    layer = build_layer(spec)
    rank = dist.get_rank()
    x, ids, weights = make_inputs(spec, rank)
    layer(x, ids, weights)  # a forward that works: the group is up
    how, when = scenario.split("_")
    if rank == victim:
        if when == "before":
            die(how)
        layer.experts.forward = lambda dispatched: die(how)
        layer(x, ids, weights)  # raises after taking part in the combine
        return None
    start = time.monotonic()
    try:
        layer(x, ids, weights)
        ended = ("none", "")
    except Exception as error:
        ended = (type(error).__name__, str(error))
    seconds = time.monotonic() - start
    layer.close()  # an application's own teardown
    return {"rank": rank, "error_type": ended[0], "message": ended[1], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "victim"):
        parser.add_argument(f"--{name}", type=int, required=True)
    for name in ("scenario", "mode", "layout"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    store = join_store(LOOPBACK, args.port, args.world + 1, 60)
    apply_interface_defaults(LOOPBACK)  # gloo on loopback, as the store
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60)
    )
    reaction = dying_forward(args.victim, args.scenario, args.mode, args.layout)
    if reaction is not None:
        print(json.dumps(reaction), flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
