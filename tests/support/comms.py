"""Comms for tests that build a setup without a process group: a world of one, or a described
group of several ranks that only refusals and placements read (it never communicates)."""

from __future__ import annotations

import torch

from ep_runtime.comm import Comm, GroupComm, SingleRankComm


def comm_without_group(world_size: int, device: str | torch.device, rank: int = 0) -> Comm:
    device = torch.device(device)
    if world_size == 1:
        return SingleRankComm(device)
    return GroupComm(None, rank, world_size, device)
