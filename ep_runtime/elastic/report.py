"""What a recovery did: who was lost, how long each step took, where the experts came from, and
the balance of the load before and after."""

from __future__ import annotations

from dataclasses import dataclass

from ep_runtime.eplb.stats import LoadStats


@dataclass(frozen=True)
class LayerRecovery:
    """One layer's re-homing. ``before``: the load the survivors counted, on the placement of
    the lost group; ``after``: the same load on the new placement (predicted; the launcher
    measures the next forwards)."""

    layer: int
    origins: dict[str, int]  # physical slots per origin: kept / moved / source
    from_replicas: tuple[int, ...]  # the lost ranks' experts that a survivor also held
    from_source: tuple[int, ...]  # the lost ranks' experts read from the weight source
    before: LoadStats
    after: LoadStats
    placement: str  # the new placement's fingerprint (the same on every survivor)


@dataclass(frozen=True)
class Recovery:
    """One recovery on this rank (the same on every survivor, timings aside)."""

    generation: int  # the group's generation after it (the first group is 0)
    lost: tuple[int, ...]  # original ranks left out
    members: tuple[int, ...]  # original ranks of the new group, by new rank
    attempts: int  # generations tried (a death during the recovery starts another)
    members_s: float  # from the start of the recovery to the agreed member list
    reform_s: float  # the new process group
    rehome_s: float  # holdings shared, placement planned, weights moved and read
    rebuild_s: float  # every layer built on the new group and serving
    layers: tuple[LayerRecovery, ...]

    @property
    def total_s(self) -> float:
        return self.members_s + self.reform_s + self.rehome_s + self.rebuild_s

    def origins(self) -> dict[str, int]:
        """Slots per origin over every layer."""
        total: dict[str, int] = {}
        for layer in self.layers:
            for origin, count in layer.origins.items():
                total[origin] = total.get(origin, 0) + count
        return total

    def lines(self) -> list[str]:
        origins = ", ".join(f"{count} {origin}" for origin, count in self.origins().items())
        replicas = sum(len(layer.from_replicas) for layer in self.layers)
        read = sum(len(layer.from_source) for layer in self.layers)
        worst_before = max((layer.before.rank_imbalance for layer in self.layers), default=1.0)
        worst_after = max((layer.after.rank_imbalance for layer in self.layers), default=1.0)
        return [
            f"lost rank(s) {list(self.lost)}; survivors {list(self.members)} are ranks "
            f"0..{len(self.members) - 1} of generation {self.generation} "
            f"({self.attempts} attempt{'s' if self.attempts > 1 else ''})",
            f"recovery {self.total_s:.2f} s: members agreed {self.members_s:.2f} s, group "
            f"{self.reform_s:.2f} s, weights re-homed {self.rehome_s:.2f} s, layers rebuilt "
            f"{self.rebuild_s:.2f} s",
            f"the lost ranks' experts: {replicas} from replicas on survivors, {read} read from "
            f"the weight source; slots: {origins}",
            f"busiest rank / mean: {worst_before:.3f} on the lost group's placement, "
            f"{worst_after:.3f} after (predicted, worst layer)",
        ]
