"""Load balance as numbers a report prints: busiest rank and hottest slot against their means,
and what a rebalance did (time, slots and bytes moved)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.eplb.placement_map import PlacementMap


@dataclass(frozen=True)
class LoadStats:
    """Per-rank and per-physical-slot load: max and mean (token-slot assignments)."""

    rank_max: float
    rank_mean: float
    slot_max: float
    slot_mean: float

    @staticmethod
    def of_slots(slot_load: torch.Tensor, placement: PlacementMap) -> LoadStats:
        """From a measured ``[E + R]`` per-slot load."""
        slots = slot_load.double().cpu()
        ranks = placement.rank_load(slots)
        return LoadStats(
            float(ranks.max()), float(ranks.mean()), float(slots.max()), float(slots.mean())
        )

    @staticmethod
    def predicted(logical_load: torch.Tensor, placement: PlacementMap) -> LoadStats:
        """What ``placement`` would give ``[E]`` logical load, each expert's load split evenly
        over its replicas."""
        load = logical_load.double().cpu()
        per_replica = load / placement.replica_counts.double()
        index = torch.tensor(placement.physical_to_logical, dtype=torch.int64)
        return LoadStats.of_slots(per_replica[index], placement)

    @property
    def rank_imbalance(self) -> float:
        """Busiest rank / mean rank (1.0 = balanced; 1.0 when nothing was counted)."""
        return self.rank_max / self.rank_mean if self.rank_mean > 0 else 1.0

    @property
    def slot_imbalance(self) -> float:
        return self.slot_max / self.slot_mean if self.slot_mean > 0 else 1.0

    def line(self, label: str) -> str:
        return (
            f"{label}: busiest rank {self.rank_imbalance:.3f}x mean "
            f"({self.rank_max:.0f} / {self.rank_mean:.1f}), hottest slot "
            f"{self.slot_imbalance:.3f}x mean ({self.slot_max:.0f} / {self.slot_mean:.1f})"
        )


@dataclass(frozen=True)
class RebalanceReport:
    """One rebalance: the load it saw (``before``, as measured on the old map), the balance the
    new map gives that load (``after``, predicted), and what moved."""

    before: LoadStats
    after: LoadStats
    changed_slots: int  # slots whose expert changed
    local_copies: int  # of those, filled from a slot on the same rank
    remote_slots: int  # filled over the network
    bytes_moved: int  # bytes of expert weights sent between ranks (all ranks together)
    seconds: float

    def lines(self) -> list[str]:
        return [
            self.before.line("load before rebalance"),
            self.after.line("predicted after"),
            f"rebalance: {self.seconds * 1e3:.1f} ms, {self.changed_slots} slots changed "
            f"({self.local_copies} local copies, {self.remote_slots} sent), "
            f"{self.bytes_moved / 2**20:.2f} MiB moved",
        ]


@dataclass(frozen=True)
class LoadSummary:
    """A run's load: measured before the first rebalance and after the last (if any)."""

    before: LoadStats
    after: LoadStats | None
    rebalances: tuple[RebalanceReport, ...]

    def lines(self) -> list[str]:
        lines = [self.before.line("expert load (first window)")]
        if self.after is not None:
            lines.append(self.after.line("expert load (after rebalancing)"))
        if self.rebalances:
            seconds = sum(r.seconds for r in self.rebalances)
            moved = sum(r.bytes_moved for r in self.rebalances)
            lines.append(
                f"rebalances: {len(self.rebalances)}, {seconds * 1e3:.1f} ms in all, "
                f"{moved / 2**20:.2f} MiB of expert weights moved"
            )
        return lines
