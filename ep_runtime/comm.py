"""The few collectives EP needs, over a torch.distributed group or a world of one process."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Comm:
    """A process group (or none: a world of 1), its rank and size, and the device data moves on."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device

    @staticmethod
    def create(group: dist.ProcessGroup | None, device: torch.device | None = None) -> Comm:
        """Wrap ``group``; ``None`` means the default group if initialised, else a world of 1."""
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is None:
            rank, world_size = 0, 1
        else:
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if device is None:
            device = default_device(group)
        return Comm(group=group, rank=rank, world_size=world_size, device=device)

    @property
    def backend(self) -> str:
        return "none" if self.group is None else str(dist.get_backend(self.group))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        """Uneven all-to-all along dim 0 (the list form fails on gloo with uneven sizes)."""
        if self.group is None:
            output.copy_(input)
            return
        dist.all_to_all_single(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=self.group,
        )

    def all_gather_object(self, obj: object) -> list[object]:
        if self.group is None:
            return [obj]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


def default_device(group: dist.ProcessGroup | None) -> torch.device:
    """CUDA (the current device) for NCCL groups, or for no group when CUDA exists; else CPU."""
    if group is not None:
        backend = str(dist.get_backend(group))
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
