"""An IMITATION of torch's ``all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset``, for testing the
torch_symm_mem adapter's logic only.

This is not NVSHMEM and not the real ops; a test passing against it says nothing about them.
It reproduces, in plain torch over a gloo group (or a world of one), the semantics quoted in
ep_runtime/dispatch/torch_symm_mem.py's docstring from PyTorch's nvshmem_extension.cu and
test/distributed/test_nvshmem.py:
- 2-D op: rank-major ``in_splits [W·ne]`` -> expert-major output (index ``e·W + src``), chunks
  packed within an expert group, each group aligned up to ``major_align`` and at least
  ``major_align`` rows long even when empty; ``out_splits_offsets [2, W·ne]`` = splits and
  exclusive offsets. Rows it does not write keep whatever they held.
- offset op: expert-major ``in_splits_offsets [2, ne·W]`` (any offsets, padding allowed) ->
  rank-major output (index ``src·ne + e``), packed, exclusive offsets.
Symmetric buffers are plain tensors filled with 0xFF bytes (NaN for floats, -1 for ints), so a
read of a row the op never wrote shows up.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.dispatch.base import DISPATCHERS, DispatchSetup
from ep_runtime.dispatch.torch_symm_mem import SymmetricTransport, TorchSymmMemDispatcher

Pieces = list[tuple[int, torch.Tensor]]  # (first output row, rows) written by an op


def imitation_all_to_all_vdev_2d(
    rank: int, inputs: list[torch.Tensor], in_splits: list[torch.Tensor], major_align: int = 1
) -> tuple[Pieces, torch.Tensor]:
    """What ``rank`` receives: (pieces, ``out_splits_offsets [2, W·ne]``), given every rank's
    input and rank-major splits."""
    world = len(inputs)
    num_experts = in_splits[0].numel() // world
    splits = [s.to(torch.int64).view(world, num_experts) for s in in_splits]
    starts = [(s.reshape(-1).cumsum(0) - s.reshape(-1)).view(world, num_experts) for s in splits]
    out_splits = torch.zeros(num_experts, world, dtype=torch.int64)
    out_offsets = torch.zeros(num_experts, world, dtype=torch.int64)
    pieces: Pieces = []
    cursor = 0
    for expert in range(num_experts):
        group_start = cursor
        for source in range(world):
            count = int(splits[source][rank, expert])
            begin = int(starts[source][rank, expert])
            out_splits[expert, source] = count
            out_offsets[expert, source] = cursor
            pieces.append((cursor, inputs[source][begin : begin + count]))
            cursor += count
        length = cursor - group_start
        cursor = group_start + max(-(-length // major_align) * major_align, major_align)
    return pieces, torch.stack([out_splits.reshape(-1), out_offsets.reshape(-1)])


def imitation_all_to_all_vdev_2d_offset(
    rank: int, inputs: list[torch.Tensor], in_splits_offsets: list[torch.Tensor]
) -> tuple[Pieces, torch.Tensor]:
    """What ``rank`` receives from the reverse op: (pieces, ``out_splits_offsets [2, W·ne]``)."""
    world = len(inputs)
    num_experts = in_splits_offsets[0].size(1) // world
    out_splits = torch.zeros(world, num_experts, dtype=torch.int64)
    out_offsets = torch.zeros(world, num_experts, dtype=torch.int64)
    pieces: Pieces = []
    cursor = 0
    for source in range(world):
        table = in_splits_offsets[source].to(torch.int64).view(2, num_experts, world)
        for expert in range(num_experts):
            count, begin = int(table[0, expert, rank]), int(table[1, expert, rank])
            out_splits[source, expert] = count
            out_offsets[source, expert] = cursor
            pieces.append((cursor, inputs[source][begin : begin + count]))
            cursor += count
    return pieces, torch.stack([out_splits.reshape(-1), out_offsets.reshape(-1)])


class ImitationSymmTransport(SymmetricTransport):
    """The two ops imitated over ``comm``'s gloo group: every rank gathers every input."""

    major_align = 1  # what the real transport passes

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(*shape, dtype=dtype, device=self.comm.device)
        tensor.view(torch.uint8).fill_(0xFF)
        return tensor

    def ready(self) -> None:
        self.comm.barrier()

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.comm.group is None:
            return [tensor.clone()]
        as_bytes = tensor.contiguous().view(torch.uint8)
        gathered = [torch.empty_like(as_bytes) for _ in range(self.comm.world_size)]
        dist.all_gather(gathered, as_bytes, group=self.comm.group)
        return [g.view(tensor.dtype).view(tensor.shape) for g in gathered]

    @staticmethod
    def _write(out: torch.Tensor, pieces: Pieces) -> None:
        for start, rows in pieces:
            out[start : start + rows.size(0)] = rows

    def all_to_all_2d(self, inputs, out, in_splits, out_splits_offsets) -> None:
        pieces, splits_offsets = imitation_all_to_all_vdev_2d(
            self.comm.rank, self._gather(inputs), self._gather(in_splits), self.major_align
        )
        self._write(out, pieces)
        out_splits_offsets.copy_(splits_offsets)

    def all_to_all_2d_offset(self, inputs, out, in_splits_offsets, out_splits_offsets) -> None:
        pieces, splits_offsets = imitation_all_to_all_vdev_2d_offset(
            self.comm.rank, self._gather(inputs), self._gather(in_splits_offsets)
        )
        self._write(out, pieces)
        out_splits_offsets.copy_(splits_offsets)


class ImitationBackedSymmMem(TorchSymmMemDispatcher):
    """The real adapter with the imitated ops injected, on CPU; a test-only registry name."""

    name = "torch_symm_mem_imitation"
    capabilities = dataclasses.replace(
        TorchSymmMemDispatcher.capabilities, device_types=frozenset({"cpu"}), min_world_size=1
    )
    auto_priority = -100

    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        return None

    @classmethod
    def make_transport(cls, comm: Comm, heap_bytes: int) -> SymmetricTransport:
        return ImitationSymmTransport(comm)


def register_imitation() -> str:
    """Register the imitation-backed dispatcher in this process; returns its name."""
    DISPATCHERS.register(ImitationBackedSymmMem)
    return ImitationBackedSymmMem.name
