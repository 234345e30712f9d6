"""Which weights a new placement moves, and moving them: every slot whose logical expert
changes receives it, from a slot on the same rank when one holds it (a local copy), else from
a rank that holds it (the least-loaded sender first). One all-to-all carries every remote slot
(eplb/transaction.py runs it); nothing moves for slots that keep their expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.eplb.placement_map import PlacementMap


@dataclass(frozen=True)
class Move:
    slot: int  # destination physical slot
    expert: int  # the logical expert it receives
    source_rank: int
    source_slot: int  # physical slot of the old placement that holds the expert


@dataclass(frozen=True)
class MovePlan:
    """The moves from ``old`` to ``new``, ordered by destination slot (the same on every rank)."""

    old: PlacementMap
    new: PlacementMap
    moves: tuple[Move, ...]

    def destination_rank(self, move: Move) -> int:
        return self.new.rank_of_slot(move.slot)

    @property
    def remote(self) -> tuple[Move, ...]:
        return tuple(m for m in self.moves if m.source_rank != self.destination_rank(m))

    @property
    def num_local_copies(self) -> int:
        return len(self.moves) - len(self.remote)

    def sent(self, source: int, destination: int) -> list[Move]:
        """Moves ``source`` sends to ``destination`` (another rank), in slot order."""
        return [
            m
            for m in self.remote
            if m.source_rank == source and self.destination_rank(m) == destination
        ]

    def row_counts(self, rank: int) -> tuple[list[int], list[int]]:
        """``rank``'s ``[W]`` rows sent to and received from each rank in the all-to-all of
        the remote moves (from the plan alone: no size exchange)."""
        world = self.old.world_size
        out_counts = [len(self.sent(rank, d)) if d != rank else 0 for d in range(world)]
        in_counts = [len(self.sent(s, rank)) if s != rank else 0 for s in range(world)]
        return out_counts, in_counts

    def arriving(self, rank: int) -> list[Move]:
        """Every move into ``rank``'s slots: local copies and remote ones, in slot order."""
        return [m for m in self.moves if self.destination_rank(m) == rank]


def plan_moves(old: PlacementMap, new: PlacementMap) -> MovePlan:
    """Moves for exactly the slots whose expert changes (``old.changed_slots(new)``)."""
    sends = [0] * old.world_size
    moves = []
    for slot in old.changed_slots(new):
        expert = new.physical_to_logical[slot]
        rank = new.rank_of_slot(slot)
        on_rank = [q for q in old.replicas[expert] if old.rank_of_slot(q) == rank]
        if on_rank:
            source = on_rank[0]
        else:
            source = min(old.replicas[expert], key=lambda q: (sends[old.rank_of_slot(q)], q))
            sends[old.rank_of_slot(source)] += 1
        moves.append(Move(slot, expert, old.rank_of_slot(source), source))
    return MovePlan(old, new, tuple(moves))


def flat_rows(w13: torch.Tensor, w2: torch.Tensor, local_slots: list[int]) -> torch.Tensor:
    """``[n, rows·H + H·I]``: the given local slots' weights, one row per slot."""
    index = torch.tensor(local_slots, dtype=torch.int64, device=w13.device)
    return torch.cat(
        [w13.index_select(0, index).flatten(1), w2.index_select(0, index).flatten(1)], 1
    )


def outgoing_slots(plan: MovePlan, rank: int) -> list[int]:
    """This rank's local slot index of each outgoing row, in ``exchange``'s send order."""
    base = plan.old.slots_of_rank(rank).start
    return [
        m.source_slot - base
        for d in range(plan.old.world_size)
        if d != rank
        for m in plan.sent(rank, d)
    ]


def arrivals(
    plan: MovePlan,
    rank: int,
    w13: torch.Tensor,  # [S, rows, H] this rank's slot weights before the move
    w2: torch.Tensor,  # [S, H, I]
    received: torch.Tensor,  # [n_in, F]: the remote moves' rows, by source rank then slot
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The local slot index of each arriving move and its new ``w13``/``w2`` (copies: the old
    weights are left as they are until every rank has staged its moves)."""
    base = plan.old.slots_of_rank(rank).start
    arriving = plan.arriving(rank)
    world = plan.old.world_size
    remote_order = [m.slot for s in range(world) if s != rank for m in plan.sent(s, rank)]
    remote_row = {slot: row for row, slot in enumerate(remote_order)}
    size13 = w13[0].numel()
    rows = []
    for move in arriving:
        if move.source_rank == rank:
            rows.append(flat_rows(w13, w2, [move.source_slot - base])[0])
        else:
            rows.append(received[remote_row[move.slot]])
    flat = torch.stack(rows) if rows else received.new_empty(0, received.size(1))
    new13 = flat[:, :size13].reshape(-1, *w13.shape[1:])
    new2 = flat[:, size13:].reshape(-1, *w2.shape[1:])
    return [m.slot - base for m in arriving], new13, new2
