"""Which physical slots a rank owns: the contiguous range ``[r·L, (r+1)·L)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.types import EPInputError


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

    def local_index(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[R, K']`` int64 local index in ``[0, L)`` for slots served here, ``L`` for the rest
        (-1 and other ranks' ids)."""
        local = topk_ids.to(torch.int64) - self.local_expert_offset
        num_local = self.num_local_experts
        return torch.where((local >= 0) & (local < num_local), local, num_local)
