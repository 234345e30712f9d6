"""Where every logical expert lives: ``E`` logical experts in ``E + R`` physical slots, ``S``
per rank, slot ``p`` on rank ``p // S``. The same on every rank; dispatchers and experts
backends only ever see physical slot ids and contiguous local slot ranges."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import torch

from ep_runtime.types import EPInputError


def _check_count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise EPInputError(name, f"an int >= {minimum}", value)
    return value


@dataclass(frozen=True)
class PlacementMap:
    """``physical_to_logical[p]``: the logical expert slot ``p`` holds (``E + R`` entries).

    Every logical expert has at least one replica; a rank's ``S`` slots are contiguous."""

    num_logical: int
    num_redundant: int
    world_size: int
    physical_to_logical: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_count("num_experts", self.num_logical, 1)
        _check_count("num_redundant_experts", self.num_redundant, 0)
        _check_count("world_size", self.world_size, 1)
        if self.num_physical % self.world_size != 0:
            raise EPInputError(
                "num_redundant_experts",
                f"R with (E + R) a multiple of the world size {self.world_size} "
                f"(E = {self.num_logical})",
                self.num_redundant,
            )
        p2l = tuple(int(e) for e in self.physical_to_logical)
        object.__setattr__(self, "physical_to_logical", p2l)
        if len(p2l) != self.num_physical:
            raise EPInputError("physical_to_logical", f"{self.num_physical} entries", len(p2l))
        if any(not 0 <= e < self.num_logical for e in p2l):
            raise EPInputError(
                "physical_to_logical", f"logical ids in [0, {self.num_logical})", list(p2l)
            )
        missing = sorted(set(range(self.num_logical)) - set(p2l))
        if missing:
            raise EPInputError(
                "physical_to_logical", "every logical expert in at least one slot", missing
            )

    @staticmethod
    def initial(num_logical: int, num_redundant: int, world_size: int) -> PlacementMap:
        """Each logical expert once, in order (rank r holds ``[r·L, (r+1)·L)`` when R = 0), then
        R replicas of experts ``0, 1, …`` in the redundant slots (``p2l[p] = p mod E``)."""
        _check_count("num_experts", num_logical, 1)
        _check_count("num_redundant_experts", num_redundant, 0)
        return PlacementMap(
            num_logical,
            num_redundant,
            world_size,
            tuple(p % num_logical for p in range(num_logical + num_redundant)),
        )

    @property
    def num_physical(self) -> int:
        return self.num_logical + self.num_redundant

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.world_size

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def slots_of_rank(self, rank: int) -> range:
        size = self.slots_per_rank
        return range(rank * size, (rank + 1) * size)

    def experts_on_rank(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each of ``rank``'s slots, in slot order."""
        return tuple(self.physical_to_logical[p] for p in self.slots_of_rank(rank))

    @cached_property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """``replicas[e]``: the physical slots holding logical expert ``e``, ascending."""
        slots: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, expert in enumerate(self.physical_to_logical):
            slots[expert].append(slot)
        return tuple(tuple(s) for s in slots)

    @property
    def replica_counts(self) -> torch.Tensor:
        """``[E]`` int64, each ≥ 1."""
        return torch.tensor([len(s) for s in self.replicas], dtype=torch.int64)

    @property
    def max_replicas(self) -> int:
        return max(len(s) for s in self.replicas)

    def logical_to_physical(self, width: int | None = None) -> torch.Tensor:
        """``[E, width]`` int64 (``width`` defaults to ``max_replicas``): each expert's slots,
        padded with -1."""
        width = self.max_replicas if width is None else width
        table = torch.full((self.num_logical, width), -1, dtype=torch.int64)
        for expert, slots in enumerate(self.replicas):
            table[expert, : len(slots)] = torch.tensor(slots, dtype=torch.int64)
        return table

    @property
    def is_identity(self) -> bool:
        """No redundancy and slot p holds expert p: ids need no mapping."""
        return self.num_redundant == 0 and all(
            p == e for p, e in enumerate(self.physical_to_logical)
        )

    def fingerprint(self) -> str:
        """A stable digest of the whole map, for cross-rank agreement."""
        text = f"{self.num_logical}/{self.num_redundant}/{self.world_size}:" + ",".join(
            map(str, self.physical_to_logical)
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def fold(self, physical_load: torch.Tensor) -> torch.Tensor:
        """``[E + R]`` per-slot load → ``[E]`` per-logical-expert load (same dtype)."""
        if tuple(physical_load.shape) != (self.num_physical,):
            raise EPInputError("load", f"shape [{self.num_physical}]", list(physical_load.shape))
        index = torch.tensor(self.physical_to_logical, device=physical_load.device)
        folded = torch.zeros(self.num_logical, dtype=physical_load.dtype, device=index.device)
        return folded.index_add_(0, index, physical_load)

    def rank_load(self, physical_load: torch.Tensor) -> torch.Tensor:
        """``[E + R]`` per-slot load → ``[W]`` per-rank load."""
        return physical_load.view(self.world_size, self.slots_per_rank).sum(1)

    def changed_slots(self, new: PlacementMap) -> list[int]:
        """Slots whose logical expert differs between this map and ``new``."""
        if (new.num_logical, new.num_redundant, new.world_size) != (
            self.num_logical,
            self.num_redundant,
            self.world_size,
        ):
            raise EPInputError(
                "placement",
                f"E={self.num_logical}, R={self.num_redundant}, W={self.world_size}",
                f"E={new.num_logical}, R={new.num_redundant}, W={new.world_size}",
            )
        old, now = self.physical_to_logical, new.physical_to_logical
        return [p for p in range(self.num_physical) if old[p] != now[p]]

    def describe(self) -> str:
        per_rank = "; ".join(
            f"rank {r}: {list(self.experts_on_rank(r))}" for r in range(self.world_size)
        )
        duplicated = {e: n for e, n in Counter(self.physical_to_logical).items() if n > 1}
        return f"E={self.num_logical} R={self.num_redundant} replicas={duplicated} | {per_rank}"
