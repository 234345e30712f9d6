"""One rank of a group in which one rank is SIGKILLed inside a placement change, run as its own
script (``python -m``): the victim kills itself as it enters one step of ``layer.rebalance()``
(eplb/transaction.py); every survivor prints one JSON line: how its rebalance ended and how long
it took, the placement and slot weights it holds afterwards, and how its next forward ended."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from ep_runtime.eplb.transaction import PlacementChange
from ep_runtime.launch.network import apply_interface_defaults
from ep_runtime.launch.rendezvous import LOOPBACK, join_store
from tests.multigpu.rank_inputs import CaseSpec, build_layer
from tests.multigpu.rebalance_faults import forward_matches, slots_hold_their_experts

# where the victim dies: as it enters each collective of the change, or after its vote
KILL_POINTS = ("open", "sum_load", "agree", "exchange", "vote", "after_vote")


def die(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(layer, point: str) -> None:
    """Make the victim die at ``point`` of its next placement change."""
    if point == "open":
        layer.dispatcher.open_placement_change = die
    elif point == "vote":
        layer.dispatcher.comm.vote = die
    elif point == "after_vote":
        PlacementChange.commit = die
    else:
        setattr(PlacementChange, point, die)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "victim", "redundant"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--point", choices=KILL_POINTS, required=True)
    args = parser.parse_args()
    store = join_store(LOOPBACK, args.port, args.world + 1, 60)
    apply_interface_defaults(LOOPBACK)
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60)
    )
    spec = CaseSpec(experts="grouped_mm", num_experts=16 - args.redundant, hidden=64, cap=32)
    layer = build_layer(spec, args.redundant)
    forward_matches(layer, spec, seed=1)  # the group is up and counted a skewed load
    initial = layer.placement
    if args.rank == args.victim:
        arm(layer, args.point)
    start = time.monotonic()
    try:
        layer.rebalance()
        ended = ("none", "")
    except Exception as error:
        ended = (type(error).__name__, str(error))
    seconds = time.monotonic() - start
    start = time.monotonic()
    try:
        forward_matches(layer, spec, seed=2)
        after = ("none", "")
    except Exception as error:
        after = (type(error).__name__, str(error))
    print(
        json.dumps(
            {
                "rank": args.rank,
                "error_type": ended[0],
                "message": ended[1],
                "seconds": seconds,
                "fingerprint": layer.placement.fingerprint(),
                "initial": layer.placement == initial,
                "slots_hold_their_experts": slots_hold_their_experts(layer, spec),
                "next_error_type": after[0],
                "next_message": after[1],
                "next_seconds": time.monotonic() - start,
            }
        ),
        flush=True,
    )
    layer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
