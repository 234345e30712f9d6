"""One rank of an elastic group that loses ranks, run as its own script (``python -m``): ranks
named in ``--kills`` SIGKILL themselves (``R@N``: as forward N starts; ``R@rebalanceN``: inside
the weights' exchange of a rebalance after forward N; ``R@recovery``, ``R@recovery-members``,
``R@recovery-vote``: inside the next recovery's re-homing, as it joins the member list, as it
votes). Every forward is checked against ``reference_moe``; each survivor prints one JSON
line: what failed and when, each recovery, the seconds from each kill to the next correct
forward, the load balance measured after the last recovery, and its placement and slots."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

from ep_runtime import EPMoE, reference_moe
from ep_runtime.elastic import ElasticGroup
from ep_runtime.elastic import group as elastic_group
from ep_runtime.eplb import zipf_popularity
from ep_runtime.eplb.stats import LoadStats
from ep_runtime.eplb.transaction import PlacementChange
from ep_runtime.launch.network import apply_interface_defaults
from ep_runtime.launch.rendezvous import LOOPBACK, join_store
from ep_runtime.tolerance import compare_per_token, tolerance_for
from tests.multigpu.rank_inputs import CaseSpec, make_weights
from tests.multigpu.rebalance_faults import slots_hold_their_experts

KILLED_AT = "elastic_test/killed_at/"


def die(store, rank: int):
    def kill(*args, **kwargs):
        store.set(f"{KILLED_AT}{rank}", str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


def zipf_inputs(spec: CaseSpec, forward: int, rank: int):
    """``T`` tokens per rank, K experts each drawn from one fixed Zipf(1.2) popularity."""
    generator = torch.Generator().manual_seed(forward * 1009 + rank)
    tokens = spec.cap
    popularity = zipf_popularity(spec.num_experts, 1.2, seed=7)
    ids = torch.multinomial(popularity.expand(tokens, -1), spec.top_k, generator=generator)
    weights = torch.rand(tokens, spec.top_k, generator=generator) + 0.5
    x = torch.randn(tokens, spec.hidden, generator=generator).to(spec.dtype)
    return x, ids, weights


def correct(layer: EPMoE, spec: CaseSpec, forward: int, rank: int) -> bool:
    x, ids, weights = zipf_inputs(spec, forward, rank)
    w13, w2 = make_weights(spec)
    ref, scale = reference_moe(x, ids, weights, w13, w2, spec.activation, return_scale=True)
    out = layer(x, ids, weights)
    layer.check()
    tolerance = tolerance_for(spec.dtype, max(spec.hidden, spec.intermediate))
    return compare_per_token(out, ref, tolerance, scale).passed


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "redundant", "forwards"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--kills", required=True)
    parser.add_argument("--mode", default="exact")
    parser.add_argument("--layout", default="standard")
    parser.add_argument("--source", choices=("yes", "no"), default="yes")
    args = parser.parse_args()
    store = join_store(LOOPBACK, args.port, None, 60)
    apply_interface_defaults(LOOPBACK)
    kills = dict(item.split("@") for item in args.kills.split(","))
    my_kill = kills.get(str(args.rank), "")
    group = ElasticGroup(store, args.rank, args.world, device="cpu", timeout_s=30)
    spec = CaseSpec(
        experts="grouped_mm",
        layout=args.layout,
        mode=args.mode,
        num_experts=32,
        top_k=4,
        hidden=64,
        intermediate=32,
        cap=48,
        dtype=torch.float32,
    )
    w13, w2 = make_weights(spec)
    layer = EPMoE(
        spec.config(),
        dispatcher="torch_a2a",
        experts=spec.experts,
        layout=spec.layout,
        mode=spec.mode,
        max_tokens_per_rank=spec.cap,
        num_redundant_experts=args.redundant,
        elastic=group,
        weight_source=(lambda ids: (w13[list(ids)], w2[list(ids)]))
        if args.source == "yes"
        else None,
    )
    layer.load_weights(w13, w2)
    if my_kill == "recovery":  # inside the re-homing's exchange
        elastic_group.exchange_and_assemble = die(store, args.rank)
    if my_kill == "recovery-members":  # as it joins the next generation
        elastic_group.agree_members = die(store, args.rank)
    if my_kill == "recovery-vote":  # as it votes on the re-homing
        ElasticGroup._vote = die(store, args.rank)
    events, first_correct = [], {}
    for forward in range(args.forwards):
        if my_kill == str(forward):
            die(store, args.rank)()
        if my_kill == f"rebalance{forward}":
            PlacementChange.exchange = die(store, args.rank)
        try:
            recoveries = len(group.recoveries)
            ok = correct(layer, spec, forward, group.rank)
            if f"rebalance{forward}" in kills.values():
                layer.rebalance()  # every rank: the victim dies inside it
            now = time.time()
            if len(group.recoveries) > recoveries and ok:
                first_correct[len(group.recoveries)] = now
            events.append({"forward": forward, "ok": ok, "world": group.world_size})
        except Exception as error:
            events.append({"forward": forward, "error": f"{type(error).__name__}: {error}"})
    load = layer.expert_load()
    measured = LoadStats.of_slots(load, layer.placement)
    killed = [f"{KILLED_AT}{r}" for r in kills if store.check([f"{KILLED_AT}{r}"])]
    kill_times = sorted(float(store.get(key)) for key in killed)
    print(
        json.dumps(
            {
                "rank": args.rank,
                "new_rank": group.rank,
                "world": group.world_size,
                "events": events,
                "recoveries": [r.lines() for r in group.recoveries],
                "lost": [list(r.lost) for r in group.recoveries],
                "origins": [r.origins() for r in group.recoveries],
                "kill_times": kill_times,
                "first_correct": [first_correct.get(i + 1) for i in range(len(group.recoveries))],
                "imbalance": measured.rank_imbalance,
                "fingerprint": layer.placement.fingerprint(),
                "slots_hold_their_experts": slots_hold_their_experts(layer, spec),
            }
        ),
        flush=True,
    )
    layer.close()


if __name__ == "__main__":
    main()
