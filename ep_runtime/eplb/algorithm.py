"""DeepSeek's expert-parallel load balancing (EPLB), from its description: replicate the experts
with the highest load per replica into the redundant slots, then pack the physical experts onto
ranks so every rank carries about the same load. Where the ranks span several nodes, the
hierarchical form first packs expert groups onto nodes, replicates within each node and packs
each node's physical experts onto its GPUs, so a replica never leaves its group's node.

Everything here is plain host arithmetic on one load vector, deterministic (ties broken by
index), so every rank computes the same map from the same load. Packs are matched to the ranks
(and slots within a rank) that already hold most of their experts, so few weights move.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from ep_runtime.eplb.placement_map import PlacementMap
from ep_runtime.types import EPInputError


def replicate(load: Sequence[float], num_slots: int) -> list[int]:
    """Replica count per expert: one each, then every further slot to the expert with the
    highest load per replica (lowest id on ties)."""
    counts = [1] * len(load)
    for _ in range(num_slots - len(load)):
        best = max(range(len(load)), key=lambda e: (load[e] / counts[e], -e))
        counts[best] += 1
    return counts


def balanced_packing(weights: Sequence[float], num_packs: int) -> list[list[int]]:
    """Split items into ``num_packs`` packs of equal size, balancing the summed weight: the
    heaviest item first, each into the lightest pack with room (lowest pack on ties)."""
    per_pack = len(weights) // num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    totals = [0.0] * num_packs
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_packs = [p for p in range(num_packs) if len(packs[p]) < per_pack]
        pack = min(open_packs, key=lambda p: (totals[p], p))
        packs[pack].append(item)
        totals[pack] += weights[item]
    return packs


def _replicated_packs(
    experts: Sequence[int], load: Sequence[float], num_slots: int, num_packs: int
) -> list[list[int]]:
    """Replicate ``experts`` into ``num_slots`` physical experts and pack them into
    ``num_packs`` equal packs: each pack a list of logical ids."""
    counts = dict(zip(experts, replicate([load[e] for e in experts], num_slots), strict=True))
    physical = [e for e in experts for _ in range(counts[e])]
    weights = [load[e] / counts[e] for e in physical]
    return [[physical[i] for i in pack] for pack in balanced_packing(weights, num_packs)]


def _overlap(a: Counter, b: Counter) -> int:
    return sum(min(n, b[e]) for e, n in a.items())


def _match(packs: Sequence[Sequence[int]], holders: Sequence[Sequence[int]]) -> list[int]:
    """``order[i]``: which pack goes to holder ``i`` (rank or node), greedily maximising the
    experts a holder already has (the weights that need not move)."""
    pack_counts = [Counter(p) for p in packs]
    holder_counts = [Counter(h) for h in holders]
    pairs = sorted(
        (-_overlap(pack_counts[p], holder_counts[h]), p, h)
        for p in range(len(packs))
        for h in range(len(holders))
    )
    order = [-1] * len(holders)
    used: set[int] = set()
    for _, pack, holder in pairs:
        if order[holder] < 0 and pack not in used:
            order[holder] = pack
            used.add(pack)
    return order


def _keep_slots(old_slots: Sequence[int], new_experts: Sequence[int]) -> list[int]:
    """One rank's slots: an expert that stays on the rank keeps its slot; the others fill the
    freed slots in ascending id order."""
    remaining = Counter(new_experts)
    slots: list[int | None] = []
    for expert in old_slots:
        if remaining[expert] > 0:
            remaining[expert] -= 1
            slots.append(expert)
        else:
            slots.append(None)
    incoming = iter(sorted(remaining.elements()))
    return [next(incoming) if e is None else e for e in slots]


def hierarchical_applies(
    num_logical: int, world_size: int, num_nodes: int, num_groups: int | None
) -> bool:
    """The hierarchical form needs whole groups per node and whole ranks per node."""
    groups = num_logical if num_groups is None else num_groups
    return (
        num_nodes > 1
        and world_size % num_nodes == 0
        and num_logical % groups == 0
        and groups % num_nodes == 0
    )


def rebalanced_placement(
    load: torch.Tensor | Sequence[float],
    old: PlacementMap,
    *,
    num_nodes: int = 1,
    num_groups: int | None = None,
    holders: Sequence[Sequence[int]] | None = None,
) -> PlacementMap:
    """A new map for the measured per-logical-expert ``load [E]`` (any non-negative numbers):
    hierarchical when ``hierarchical_applies`` (``num_groups`` None: every expert its own
    group), global otherwise. Experts that stay on a rank keep their slots in ``old``.
    ``holders``: the experts each rank holds now, where that is not ``old`` (a group re-formed
    after a rank loss: ``old`` only gives the new shape); packs go to the ranks holding most of
    their experts, which keep them in their first slots."""
    num_logical, world_size = old.num_logical, old.world_size
    values = [float(v) for v in (load.tolist() if isinstance(load, torch.Tensor) else load)]
    if len(values) != num_logical:
        raise EPInputError("load", f"{num_logical} per-expert values", len(values))
    if any(not v >= 0 for v in values):  # also refuses NaN
        raise EPInputError("load", "non-negative finite values", values)
    if num_groups is not None and (num_groups < 1 or num_logical % num_groups != 0):
        raise EPInputError("num_groups", f"a divisor of {num_logical}", num_groups)
    old_ranks = [old.experts_on_rank(r) for r in range(world_size)]
    if holders is not None:
        if len(holders) != world_size:
            raise EPInputError("holders", f"{world_size} ranks' experts", len(holders))
        old_ranks = [_held_in_slots(held, old.slots_per_rank) for held in holders]
    if holders is None and hierarchical_applies(num_logical, world_size, num_nodes, num_groups):
        rank_packs = _hierarchical_packs(values, old, num_nodes, num_groups or num_logical)
    else:
        packs = _replicated_packs(list(range(num_logical)), values, old.num_physical, world_size)
        rank_packs = [packs[i] for i in _match(packs, old_ranks)]
    physical_to_logical = [
        expert
        for rank in range(world_size)
        for expert in _keep_slots(old_ranks[rank], rank_packs[rank])
    ]
    return PlacementMap(num_logical, old.num_redundant, world_size, tuple(physical_to_logical))


def _held_in_slots(held: Sequence[int], num_slots: int) -> tuple[int, ...]:
    """A rank's held experts as ``num_slots`` slot contents (-1: a slot holding nothing yet)."""
    kept = tuple(held[:num_slots])
    return kept + (-1,) * (num_slots - len(kept))


def _hierarchical_packs(
    load: Sequence[float], old: PlacementMap, num_nodes: int, num_groups: int
) -> list[list[int]]:
    """Groups → nodes (balanced), replicas within each node, physical experts → the node's
    GPUs; nodes and GPUs matched to where the experts already are."""
    per_group = old.num_logical // num_groups
    group_load = [sum(load[g * per_group : (g + 1) * per_group]) for g in range(num_groups)]
    node_groups = balanced_packing(group_load, num_nodes)
    ranks_per_node = old.world_size // num_nodes
    old_ranks = [old.experts_on_rank(r) for r in range(old.world_size)]
    old_nodes = [
        [e for r in range(n * ranks_per_node, (n + 1) * ranks_per_node) for e in old_ranks[r]]
        for n in range(num_nodes)
    ]
    node_experts = [
        sorted(e for g in groups for e in range(g * per_group, (g + 1) * per_group))
        for groups in node_groups
    ]
    node_order = _match(node_experts, old_nodes)
    rank_packs: list[list[int]] = []
    for node in range(num_nodes):
        experts = node_experts[node_order[node]]
        packs = _replicated_packs(experts, load, old.num_physical // num_nodes, ranks_per_node)
        node_ranks = old_ranks[node * ranks_per_node : (node + 1) * ranks_per_node]
        rank_packs += [packs[i] for i in _match(packs, node_ranks)]
    return rank_packs


def node_count(hosts: Sequence[str]) -> int:
    """Nodes the ranks span, where each node holds one contiguous block of ranks of the same
    size (the layout the hierarchical form assumes); 1 otherwise."""
    blocks: list[tuple[str, int]] = []
    for host in hosts:
        if blocks and blocks[-1][0] == host:
            blocks[-1] = (host, blocks[-1][1] + 1)
        else:
            blocks.append((host, 1))
    distinct = {host for host, _ in blocks}
    if len(distinct) != len(blocks) or len({size for _, size in blocks}) != 1:
        return 1
    return len(blocks)
