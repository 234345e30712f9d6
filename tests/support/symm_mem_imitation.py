"""An IMITATION of torch's ``all_to_all_vdev_2d``, for testing the torch_symm_mem adapter's logic
only.

This is not NVSHMEM and not the real op; a test passing against it says nothing about the op. It
reproduces, in plain torch over a gloo group (or a world of one), the semantics docs/symm_mem.md
describes: rank-major ``in_splits [W·ne]`` -> expert-major output (index ``e·W + src``), chunks
packed within an expert group, each group aligned up to ``major_align`` and at least
``major_align`` rows long even when empty; ``out_splits_offsets [2, W·ne]`` = splits and
exclusive offsets. Rows it does not write keep whatever they held.
Symmetric buffers are plain tensors filled with 0xFF bytes (NaN for floats, -1 for ints), so a
read of a row the op never wrote shows up.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.dispatch.base import DISPATCHERS
from ep_runtime.dispatch.setup import DispatchSetup
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


class ImitationSymmTransport(SymmetricTransport):
    """The op imitated over ``comm``'s gloo group: every rank gathers every input."""

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
        """The op's argument checks (TORCH_CHECK and kernel asserts in PyTorch's source), then
        the exchange."""
        world = self.comm.world_size
        assert all(t.is_contiguous() for t in (inputs, out, in_splits, out_splits_offsets))
        assert in_splits.dtype == out_splits_offsets.dtype == torch.int64, "int64 splits"
        assert inputs.dtype == out.dtype and inputs.stride(0) == out.stride(0)
        assert in_splits.dim() == 1 and in_splits.numel() % world == 0
        assert out_splits_offsets.shape == (2, in_splits.numel())
        assert world <= 32 and in_splits.numel() // world <= 16, "world <= 32, ne <= 16"
        assert int(in_splits.sum()) <= inputs.size(0), "sum of splits is larger than input dim"
        pieces, splits_offsets = imitation_all_to_all_vdev_2d(
            self.comm.rank, self._gather(inputs), self._gather(in_splits), self.major_align
        )
        self._write(out, pieces)
        out_splits_offsets.copy_(splits_offsets)


class ImitationBackedSymmMem(TorchSymmMemDispatcher):
    """The real adapter with the imitated op injected, on CPU; a test-only registry name."""

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
