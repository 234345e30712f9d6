"""Which physical slots a rank owns: the contiguous range ``[r·L, (r+1)·L)``, and the one
encoding of "this rank's ids" every backend and kernel spec uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.types import EPInputError


@dataclass(frozen=True)
class LocalExperts:
    """The global ids ``[offset, offset + count)`` one rank serves. A slot is served here iff
    its id is in that range (-1 and other ranks' ids are not)."""

    offset: int
    count: int

    def index(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``' shape, int64: local index in ``[0, count)`` where served, ``count`` else."""
        local = ids.to(torch.int64) - self.offset
        return torch.where((local >= 0) & (local < self.count), local, self.count)

    def served(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``' shape, bool: the slots served here."""
        return self.index(ids) < self.count

    def own(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``' shape, int32: the global ids served here, -1 elsewhere."""
        return torch.where(self.served(ids), ids.to(torch.int32), -1)

    def to_global(self, local: torch.Tensor, served: torch.Tensor) -> torch.Tensor:
        """int32 global ids of the local indices ``local`` where ``served``, -1 elsewhere."""
        return torch.where(served, local.to(torch.int64) + self.offset, -1).to(torch.int32)


@dataclass(frozen=True)
class ExpertPlacement:
    """Contiguous slot ownership. With load balancing (``ep_runtime.eplb``) the layer maps
    logical ids to physical slots before dispatch and builds this for ``E + R`` slots; every
    kernel sees physical ids and contiguous local ranges."""

    num_experts: int
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.num_experts % self.world_size != 0:
            raise EPInputError(
                "num_experts",
                f"a multiple of the world size {self.world_size}",
                self.num_experts,
            )
        if not 0 <= self.rank < self.world_size:
            raise EPInputError("rank", f"in [0, {self.world_size})", self.rank)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def local_expert_offset(self) -> int:
        return self.rank * self.num_local_experts

    @property
    def local(self) -> LocalExperts:
        return LocalExperts(self.local_expert_offset, self.num_local_experts)
