"""The placement on the device: logical → physical ids before dispatch, and the per-slot load
counts (added to by the dispatcher's route, in its own launch).

The map is a few plain torch ops on tensors of fixed shape, updated in place on a rebalance: no
host read, no data-dependent shape, so a capacity-mode forward stays capturable in a CUDA graph
(a graph captured before a rebalance reads the new map when replayed after it).
"""

from __future__ import annotations

import torch

from ep_runtime.eplb.placement_map import PlacementMap


class DeviceMap:
    """``table [E, R + 1]`` (each expert's slots, -1 padded; R + 1 is the most replicas any
    expert can have, so the shape never changes), ``counts [E]`` and ``load [E + R]``, all int64
    on ``device``."""

    def __init__(self, placement: PlacementMap, device: torch.device) -> None:
        width = placement.num_redundant + 1
        self.num_logical = placement.num_logical
        self.num_physical = placement.num_physical
        self.table = placement.logical_to_physical(width).to(device)
        self.counts = placement.replica_counts.to(device)
        self.load = torch.zeros(self.num_physical, dtype=torch.int64, device=device)
        self.identity = placement.is_identity

    def tables(self, placement: PlacementMap) -> tuple[torch.Tensor, torch.Tensor]:
        """``placement``'s ``table`` and ``counts``, on the device, for ``install``."""
        table = placement.logical_to_physical(self.table.size(1)).to(self.table.device)
        return table, placement.replica_counts.to(self.counts.device)

    def install(self, placement: PlacementMap, table: torch.Tensor, counts: torch.Tensor) -> None:
        """Switch to ``placement`` (its ``tables``) in place (same storage, so captured graphs
        follow), and clear the load counts."""
        self.table.copy_(table)
        self.counts.copy_(counts)
        self.identity = placement.is_identity
        self.load.zero_()

    def to_physical(self, topk_ids: torch.Tensor, seed: int) -> torch.Tensor:
        """``[T, K]`` logical ids → ``[T, K]`` int32 physical slots (the ids themselves while
        the map is the identity). Token t's expert e goes to
        replica ``(t + e + seed) mod count[e]``: deterministic, spread evenly over tokens, and
        the same replica for a repeated id in a row (so the route still sees the repeat).
        -1 stays -1; an id outside ``[0, E)`` becomes ``E + R``, which the route rejects."""
        if self.identity:  # R = 0, not rebalanced: the ids pass as today
            return topk_ids
        ids = topk_ids.to(torch.int64)
        valid = (ids >= 0) & (ids < self.num_logical)
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        token = torch.arange(ids.size(0), device=ids.device, dtype=torch.int64).unsqueeze(1)
        replica = (token + safe + seed) % self.counts[safe]
        physical = self.table[safe, replica]
        invalid = torch.where(ids == -1, -1, self.num_physical)
        return torch.where(valid, physical, invalid).to(torch.int32)

    def take_load(self, reset: bool) -> torch.Tensor:
        """``[E + R]`` int64 counts recorded on this rank (a copy), cleared if ``reset``."""
        counted = self.load.clone()
        if reset:
            self.load.zero_()
        return counted
