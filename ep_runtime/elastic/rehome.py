"""Where a layer's experts go after a rank loss, and how their weights get there.

The survivors share what each holds of the layer (its experts, in slot order, and the load it
counted since the last reset); from that alone, identically on every survivor:
  - the slot count: ``E + R'`` with ``R' ≥ R`` the least that the new world size divides (the
    extra slots are replicas like any other);
  - the new placement: the EPLB algorithm over the survivors, from their summed load (uniform
    when nothing was counted), packs going to the survivors that already hold their experts;
  - each slot's source: kept (this survivor holds the expert), moved from another survivor
    that holds it (one all-to-all), or the layer's weight source (read on the slot's rank
    alone). An expert that no survivor holds, on a layer without a weight source, is gone:
    ``LostExpertsError`` names it, on every survivor alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from ep_runtime.comm import Comm
from ep_runtime.eplb.algorithm import rebalanced_placement
from ep_runtime.eplb.moves import flat_rows
from ep_runtime.eplb.placement_map import PlacementMap
from ep_runtime.types import EPInputError

# ``source(expert_ids: list[int]) -> (w13 [n, rows, H], w2 [n, H, I])``: logical experts
WeightSource = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]


class LostExpertsError(RuntimeError):
    """Experts that no survivor holds and no weight source can supply."""

    def __init__(self, layer: int, experts: Sequence[int]) -> None:
        self.layer = layer
        self.experts = tuple(experts)
        super().__init__(
            f"elastic layer {layer}: experts {list(self.experts)} were held only by the lost "
            "rank(s) and the layer has no weight source (EPMoE(weight_source=...)) nor a "
            "replica on a survivor (num_redundant_experts)"
        )

    def __reduce__(self) -> tuple:
        return type(self), (self.layer, self.experts), self.__dict__


class Origin(str, Enum):
    """Where a slot's weights come from."""

    KEPT = "kept"  # the slot's rank held the expert
    MOVED = "moved"  # another survivor held it and sends it
    SOURCE = "source"  # read from the layer's weight source


@dataclass(frozen=True)
class Holding:
    """What one survivor holds of one layer (shared by all-gather)."""

    shape: tuple[int, ...]  # (E, rows, H, I): the same on every survivor
    experts: tuple[int, ...]  # logical expert of each slot, in slot order
    load: tuple[float, ...]  # [E] logical load counted here since the last reset
    has_source: bool


@dataclass(frozen=True)
class SlotSource:
    origin: Origin
    member: int  # the new rank that sends it (KEPT: the slot's own rank; SOURCE: -1)
    slot: int  # that rank's local slot holding it (-1 for SOURCE)


@dataclass(frozen=True)
class RehomePlan:
    """One layer's new placement over the survivors and the source of each physical slot."""

    layer: int
    placement: PlacementMap
    sources: tuple[SlotSource, ...]
    load: tuple[float, ...]  # [E] summed over the survivors

    def counts(self) -> dict[str, int]:
        """Slots per origin, over the whole group."""
        return {o.value: sum(s.origin is o for s in self.sources) for o in Origin}

    def slots_of(self, rank: int) -> range:
        return self.placement.slots_of_rank(rank)

    def sent(self, source: int, destination: int) -> list[int]:
        """Physical slots ``source`` fills on ``destination`` (another rank), in slot order."""
        return [
            p
            for p in self.slots_of(destination)
            if self.sources[p].origin is Origin.MOVED and self.sources[p].member == source
        ]

    def from_source(self, rank: int) -> list[int]:
        """``rank``'s physical slots read from the weight source."""
        return [p for p in self.slots_of(rank) if self.sources[p].origin is Origin.SOURCE]


def padded_redundancy(num_experts: int, num_redundant: int, world_size: int) -> int:
    """The least ``R' ≥ num_redundant`` with ``(E + R') % world_size == 0``."""
    return num_redundant + (-(num_experts + num_redundant)) % world_size


def plan_rehome(layer: int, holdings: Sequence[Holding], num_redundant: int) -> RehomePlan:
    """The new placement and each slot's source, from every survivor's ``Holding`` (new rank
    order). Raises ``LostExpertsError`` where an expert has no source."""
    shapes = {h.shape for h in holdings}
    if len(shapes) != 1:
        raise EPInputError(f"elastic layer {layer}", "the same shape on every survivor", shapes)
    num_experts = holdings[0].shape[0]
    world = len(holdings)
    held = {e for h in holdings for e in h.experts}
    missing = sorted(set(range(num_experts)) - held)
    if missing and not all(h.has_source for h in holdings):
        raise LostExpertsError(layer, missing)
    load = [sum(h.load[e] for h in holdings) for e in range(num_experts)]
    if sum(load) <= 0:
        load = [1.0] * num_experts
    redundant = padded_redundancy(num_experts, num_redundant, world)
    shape = PlacementMap.initial(num_experts, redundant, world)
    placement = rebalanced_placement(load, shape, holders=[h.experts for h in holdings])
    sends = [0] * world
    sources = []
    for slot, expert in enumerate(placement.physical_to_logical):
        rank = placement.rank_of_slot(slot)
        if expert in holdings[rank].experts:
            sources.append(SlotSource(Origin.KEPT, rank, holdings[rank].experts.index(expert)))
            continue
        holders = [m for m in range(world) if expert in holdings[m].experts]
        if not holders:
            sources.append(SlotSource(Origin.SOURCE, -1, -1))
            continue
        member = min(holders, key=lambda m: (sends[m], m))
        sends[member] += 1
        sources.append(SlotSource(Origin.MOVED, member, holdings[member].experts.index(expert)))
    return RehomePlan(layer, placement, tuple(sources), tuple(load))


def read_from_source(
    plan: RehomePlan, rank: int, source: WeightSource | None, like: torch.Tensor
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``rank``'s slots read from the weight source: physical slot → (w13, w2), on ``like``'s
    device and dtype."""
    slots = plan.from_source(rank)
    if not slots:
        return {}
    if source is None:  # plan_rehome refuses a plan needing a source some rank lacks
        raise LostExpertsError(plan.layer, [plan.placement.physical_to_logical[p] for p in slots])
    experts = [plan.placement.physical_to_logical[p] for p in slots]
    w13, w2 = source(experts)
    if w13.size(0) != len(experts) or w2.size(0) != len(experts):
        raise EPInputError(
            "weight_source", f"{len(experts)} experts' weights for {experts}", w13.size(0)
        )
    cast = {"device": like.device, "dtype": like.dtype}
    return {p: (w13[i].to(**cast), w2[i].to(**cast)) for i, p in enumerate(slots)}


def exchange_and_assemble(
    comm: Comm,
    plan: RehomePlan,
    w13: torch.Tensor,  # [S_old, rows, H] this rank's slots before the loss
    w2: torch.Tensor,  # [S_old, H, I]
    read: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-to-all of the experts that change rank (skipped where none does, on every rank
    alike), then this rank's new ``[S', rows, H]`` / ``[S', H, I]`` slot weights."""
    me, world = comm.rank, comm.world_size
    out_slots = [plan.sources[p].slot for d in range(world) if d != me for p in plan.sent(me, d)]
    out_counts = [len(plan.sent(me, d)) if d != me else 0 for d in range(world)]
    in_counts = [len(plan.sent(s, me)) if s != me else 0 for s in range(world)]
    width = w13[0].numel() + w2[0].numel()
    send = flat_rows(w13, w2, out_slots) if out_slots else w13.new_empty(0, width)
    any_remote = any(s.origin is Origin.MOVED for s in plan.sources)
    received = w13.new_empty(sum(in_counts), width)
    if any_remote:
        received = comm.all_to_all(
            send, recv=received, send_splits=out_counts, recv_splits=in_counts
        )
    remote_order = [p for s in range(world) if s != me for p in plan.sent(s, me)]
    remote_row = {p: row for row, p in enumerate(remote_order)}
    size13 = w13[0].numel()
    new13, new2 = [], []
    for p in plan.slots_of(me):
        origin = plan.sources[p]
        if origin.origin is Origin.KEPT:
            new13.append(w13[origin.slot])
            new2.append(w2[origin.slot])
        elif origin.origin is Origin.MOVED:
            row = received[remote_row[p]]
            new13.append(row[:size13].view(w13.shape[1:]))
            new2.append(row[size13:].view(w2.shape[1:]))
        else:
            new13.append(read[p][0])
            new2.append(read[p][1])
    return torch.stack(new13), torch.stack(new2)
