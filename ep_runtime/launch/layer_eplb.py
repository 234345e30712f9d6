"""The launcher's expert load balancing (docs/eplb.md): ``--routing zipf:S``,
``--redundant-experts R`` and ``--rebalance-every N``, checked before any rank starts, and what a
rank measures of the load: per-slot counts normalised to one forward, so that windows of
different lengths (warm-up, timed iterations, validation, graph replays) compare directly."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from ep_runtime.bench.metrics import destination_rows
from ep_runtime.eplb import DeviceMap, LoadSummary, PlacementMap, parse_zipf
from ep_runtime.types import EPInputError

MODEL_ROUTING = "model"  # the preset's own router


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("expert load balancing (docs/eplb.md)")
    group.add_argument(
        "--routing",
        metavar="model|zipf:S",
        help="model: the preset's router on random logits; zipf:S: K distinct experts per token, "
        "expert popularity Zipf(S) over a seeded permutation of the experts (skewed load); "
        "default: model (with --elastic: zipf:1.2)",
    )
    group.add_argument(
        "--redundant-experts",
        type=int,
        default=0,
        metavar="R",
        help="extra expert slots holding replicas of the busiest experts (E + R a multiple of "
        "--dp)",
    )
    group.add_argument(
        "--rebalance-every",
        type=int,
        metavar="N",
        help="rebalance after every N-th iteration (warm-up and timed) from the load counted "
        "since the last; the report shows the load before and after",
    )


def checked_options(
    args: argparse.Namespace, num_experts: int, world_size: int, routing_default: str
) -> dict:
    """``LayerWorkload``'s load-balancing fields (``routing_default`` where ``--routing`` was
    not given); ``ValueError`` (one line, the option named) for a bad value."""
    routing = args.routing or routing_default
    try:
        exponent = parse_zipf(routing)
    except EPInputError as error:
        raise ValueError(f"--routing: expected {error.expected}, given {routing!r}") from None
    if exponent is None and routing != MODEL_ROUTING:
        raise ValueError(f"--routing: expected model or zipf:S (S > 0), given {routing!r}")
    redundant, every = args.redundant_experts, args.rebalance_every
    if redundant < 0:
        raise ValueError(f"--redundant-experts: expected >= 0, given {redundant}")
    if redundant and (num_experts + redundant) % world_size:
        raise ValueError(
            f"--redundant-experts: expected R with E + R a multiple of --dp {world_size} "
            f"(E = {num_experts}), given {redundant}"
        )
    if every is not None and every < 1:
        raise ValueError(f"--rebalance-every: expected >= 1 iterations, given {every}")
    return {"routing": routing, "redundant_experts": redundant, "rebalance_every": every}


def refuse_with_hf_model(args: argparse.Namespace) -> None:
    """The options drive the synthetic layer only: with ``--hf-model`` they are refused, not
    ignored (``patch_moe_blocks(num_redundant_experts=R)`` is the API there)."""
    if not args.hf_model:
        return
    for option, value, default in (
        ("--routing", args.routing, None),
        ("--redundant-experts", args.redundant_experts, 0),
        ("--rebalance-every", args.rebalance_every, None),
    ):
        if value != default:
            raise ValueError(
                f"{option}: expected none with --hf-model (the synthetic layer's option), "
                f"given {value}"
            )


def physical_destinations(
    topk_ids: torch.Tensor, device_map: DeviceMap, rank: int, world_size: int
) -> list[int]:
    """``[W]``: this rank's tokens sent to each rank under ``device_map``'s placement (the
    replica each (token, expert) pair goes to, as the layer picks it)."""
    physical = device_map.to_physical(topk_ids, seed=rank)
    return destination_rows(physical, device_map.num_physical, world_size)


def initial_device_map(
    num_experts: int, redundant: int, world_size: int, device: torch.device
) -> DeviceMap:
    return DeviceMap(PlacementMap.initial(num_experts, redundant, world_size), device)


def per_forward(load: torch.Tensor, pairs_per_forward: int) -> torch.Tensor:
    """``[E + R]`` counts over a window → float64 counts of one forward: every forward of a run
    routes the same ``pairs_per_forward`` (token, expert) pairs over all ranks."""
    total = int(load.sum())
    counts = load.double().cpu()
    return counts if total == 0 or pairs_per_forward == 0 else counts * pairs_per_forward / total


def summary_json(summary: LoadSummary) -> dict:
    """What the report keeps of a layer's load: its printed lines and the numbers behind them."""
    return {
        "lines": summary.lines(),
        "before": asdict(summary.before),
        "after": None if summary.after is None else asdict(summary.after),
        "rebalances": [asdict(r) for r in summary.rebalances],
        "rank_imbalance_before": summary.before.rank_imbalance,
        "slot_imbalance_before": summary.before.slot_imbalance,
        "rank_imbalance_after": None if summary.after is None else summary.after.rank_imbalance,
        "slot_imbalance_after": None if summary.after is None else summary.after.slot_imbalance,
    }
