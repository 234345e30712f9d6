"""torch NVSHMEM symmetric-memory dispatcher: the packed-row transport of ``rows.py``, moved by
``torch.ops.symm_mem.all_to_all_vdev_2d``, which reads its split sizes on the device. So unlike
``torch_a2a``, capacity mode sends only the rows that exist (chunks packed back to back) and still
never syncs with the host.

Contract-tested only: the CPU tests run it against an imitation of the op; it has never run on
GPUs, so ``"auto"`` never picks it. What it relies on, its limits and its buffers:
docs/symm_mem.md.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.config import DEFAULT_MAX_TOKENS_PER_RANK
from ep_runtime.dispatch.base import DISPATCHERS
from ep_runtime.dispatch.protocol import Agreed, Phase
from ep_runtime.dispatch.rows import RowDispatcher, RowHandle, RowPacked
from ep_runtime.dispatch.setup import DispatcherCapabilities, DispatchSetup, PeerSetup
from ep_runtime.kernels import Route
from ep_runtime.kernels.layout import ChunkLayout
from ep_runtime.types import Dispatched, DispatchMode, EPInputError, TopkLayout

MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HEAP_SIZE_ENV = "NVSHMEM_SYMMETRIC_SIZE"  # NVSHMEM's symmetric heap; 1 GiB by default
HEAP_MARGIN_BYTES = 256 << 20
MAX_WORLD_SIZE = 32  # all_to_all_vdev_2d: world_size <= 32 (one warp's prefix sum)


class SymmetricTransport(Protocol):
    """Symmetric allocation and the one collective; tests substitute an imitation."""

    def empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor: ...

    def ready(self) -> None: ...

    def all_to_all_2d(
        self,
        inputs: torch.Tensor,  # [N, width]: per-peer chunks back to back, in rank order
        out: torch.Tensor,  # [N, width]: per-source chunks back to back, in rank order
        in_splits: torch.Tensor,  # [W] int64 rows to each peer
        out_splits_offsets: torch.Tensor,  # [2, W] int64 rows from each source, where they landed
    ) -> None: ...


def multicast_problem() -> str | None:
    """A multicast switch set to anything but off (it can take the host's GPUs out of service)."""
    wrong = [f"{k}={os.environ[k]}" for k, v in MULTICAST_OFF.items() if os.environ.get(k, v) != v]
    return f"NVLink multicast must stay off, but {', '.join(wrong)}" if wrong else None


class NvshmemTransport:
    """torch's NVSHMEM symmetric memory on ``comm``'s group (the real op)."""

    def __init__(self, comm: Comm, heap_bytes: int) -> None:
        for name, value in MULTICAST_OFF.items():
            os.environ.setdefault(name, value)
        os.environ.setdefault(HEAP_SIZE_ENV, str(heap_bytes + HEAP_MARGIN_BYTES))
        if torch.cuda.current_device() != comm.device.index:
            raise RuntimeError(
                f"torch_symm_mem: the current CUDA device is {torch.cuda.current_device()}, "
                f"this rank's is {comm.device}; call torch.cuda.set_device first"
            )
        from torch.distributed import _symmetric_memory as symm_mem

        if symm_mem.get_backend(comm.device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")  # process-wide; must precede the first allocation
        self.symm_mem = symm_mem
        self.comm = comm
        assert comm.group is not None  # refused without a group
        self.group_name = comm.group.group_name

    def empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = self.symm_mem.empty(*shape, dtype=dtype, device=self.comm.device)
        self.symm_mem.rendezvous(tensor, self.group_name)  # collective: same order on all ranks
        return tensor

    def ready(self) -> None:
        dist.barrier(group=self.comm.group)  # every peer has allocated before the first op

    def all_to_all_2d(self, inputs, out, in_splits, out_splits_offsets) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d(
            inputs, out, in_splits, out_splits_offsets, self.group_name, major_align=1
        )


@dataclass(frozen=True)
class SymmetricBuffers:
    """One phase's symmetric tensors; every rank allocates the same shapes, once."""

    send: torch.Tensor  # [W·(header rows + cap), width]
    recv: torch.Tensor  # [W·(header rows + cap), width]
    in_splits: torch.Tensor  # [W] int64 rows sent to each peer
    splits_offsets: torch.Tensor  # [2, W] int64 rows received from each source, and where


@DISPATCHERS.register
class TorchSymmMemDispatcher(RowDispatcher):
    """torch_a2a's rows and receive-side steps, moved by NVSHMEM with sizes on the device."""

    name = "torch_symm_mem"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        min_world_size=2,
    )
    auto_priority = -1  # never run on GPUs: "auto" does not pick it

    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        """Cheap checks (no allocation, no collective, no kernel)."""
        problems = [*symm_mem_problems()]
        if setup.comm.group is None:
            problems.append("needs an initialised process group of >= 2 GPUs")
        if setup.comm.world_size > MAX_WORLD_SIZE:
            problems.append(
                f"all_to_all_vdev_2d takes at most {MAX_WORLD_SIZE} ranks, "
                f"got {setup.comm.world_size}"
            )
        if (problem := multicast_problem()) is not None:
            problems.append(problem)
        return "; ".join(problems) or None

    @classmethod
    def make_transport(cls, comm: Comm, heap_bytes: int) -> SymmetricTransport:
        return NvshmemTransport(comm, heap_bytes)

    def __init__(self, setup: DispatchSetup, peer_setup: PeerSetup) -> None:
        super().__init__(setup, peer_setup)
        # chunks back to back in both modes; capacity mode bounds the buffers, not each chunk
        self.chunks = ChunkLayout(self.chunks.header_rows, None)
        world = self.comm.world_size
        self.max_round_tokens = setup.max_tokens_per_rank or DEFAULT_MAX_TOKENS_PER_RANK
        self.max_rows = world * (self.chunks.header_rows + self.max_round_tokens)
        widths = {
            Phase.DISPATCH: (self.row_format.row_bytes, torch.uint8),
            Phase.COMBINE: (setup.hidden_size, setup.dtype),
        }
        heap_bytes = sum(
            2 * self.max_rows * width * dtype.itemsize + 3 * world * 8
            for width, dtype in widths.values()
        )
        self.transport = self.make_transport(self.comm, heap_bytes)
        self.buffers = {
            phase: self._allocate(width, dtype) for phase, (width, dtype) in widths.items()
        }
        self.transport.ready()
        self.filler_row = self._filler_row()  # [1, row_bytes] uint8
        self._awaiting_combine = False

    def _allocate(self, width: int, dtype: torch.dtype) -> SymmetricBuffers:
        empty, world = self.transport.empty, self.comm.world_size
        return SymmetricBuffers(
            send=empty(self.max_rows, width, dtype=dtype),
            recv=empty(self.max_rows, width, dtype=dtype),
            in_splits=empty(world, dtype=torch.int64),
            splits_offsets=empty(2, world, dtype=torch.int64),
        )

    def _filler_row(self) -> torch.Tensor:
        """``[1, row_bytes]`` uint8: what ``pack_rows`` writes in rows without a token (hidden 0,
        NaN in poison mode, the scales too when quantized; ids -1; weights 0)."""
        row = torch.zeros(1, self.row_format.row_bytes, dtype=torch.uint8, device=self.comm.device)
        self.row_format.ids(row, self.setup.max_top_k).fill_(-1)
        if self.setup.poison:
            self.row_format.hidden(row).fill_(float("nan"))
            if self.row_format.quantized:
                self.row_format.scales(row).fill_(float("nan"))
        return row

    # ----------------------------------------------------------------- the steps that differ
    def _pack(self, x: torch.Tensor, topk_weights: torch.Tensor, route: Route) -> RowPacked:
        """The buffers hold one forward and at most ``cap`` rows per rank (the layer chunks
        longer inputs and always combines before the next dispatch)."""
        if self._awaiting_combine:
            raise RuntimeError(
                "torch_symm_mem: dispatch called again before the previous dispatch was "
                "combined; its rows live in the buffers this dispatch would overwrite"
            )
        cap = self.max_round_tokens
        if x.size(0) > cap:
            raise EPInputError("x", f"at most max_tokens_per_rank={cap} rows", x.size(0))
        return super()._pack(x, topk_weights, route)

    def _exchange_dispatch(
        self, packed: RowPacked, agreed: Agreed, layout: TopkLayout
    ) -> tuple[Dispatched, RowHandle]:
        sent = super()._exchange_dispatch(packed, agreed, layout)
        self._awaiting_combine = True
        return sent

    def _exchange_combine(
        self,
        expert_output: torch.Tensor | None,
        dispatched: Dispatched,
        handle: RowHandle,
        status: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._awaiting_combine = False
        return super()._exchange_combine(expert_output, dispatched, handle, status)

    def _new_buffer(self, phase: Phase, rows: int) -> torch.Tensor:
        """The phase's symmetric send buffer: the op reads the rows from where they are packed."""
        return self.buffers[phase].send[:rows]

    def _exchange(
        self,
        phase: Phase,
        send: torch.Tensor,  # [S, width]
        rows_per_peer: torch.Tensor,  # [W] int32 token rows of each send chunk
        send_splits: list[int] | None,
        recv_splits: list[int] | None,
    ) -> torch.Tensor:
        """One ``all_to_all_vdev_2d`` with a single bucket per rank: the chunk for peer d is
        ``header_rows + rows_per_peer[d]`` rows, and what arrives is the sources' chunks back to
        back in rank order (the packed layout of ``self.chunks``). No host sync."""
        buffers = self.buffers[phase]
        staged = buffers.send[: send.size(0)]
        if staged.data_ptr() != send.data_ptr():  # e.g. STANDARD results, written by the experts
            staged.copy_(send)
        buffers.in_splits.copy_(rows_per_peer.to(torch.int64) + self.chunks.header_rows)
        self.transport.all_to_all_2d(
            buffers.send, buffers.recv, buffers.in_splits, buffers.splits_offsets
        )
        if recv_splits is not None:  # exact mode: the host knows the size
            return buffers.recv[: sum(recv_splits)]
        recv = buffers.recv[: send.size(0)]  # static size: as many rows as were sent
        if phase is Phase.DISPATCH:  # rows past what arrived hold an earlier forward's rows
            arrived = buffers.splits_offsets[0].sum()  # 0-d
            stale = torch.arange(recv.size(0), device=arrived.device) >= arrived
            torch.where(stale.unsqueeze(1), self.filler_row, recv, out=recv)
        return recv  # combine: only rows that arrived are read

    def close(self) -> None:
        """Drop the symmetric buffers (freed with their last reference)."""
        self.buffers = {}
        super().close()


@functools.cache
def symm_mem_problems() -> tuple[str, ...]:
    """Why torch's NVSHMEM symmetric memory cannot run in this process (cached)."""
    problems = []
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "all_to_all_vdev_2d"):
        problems.append(f"torch {torch.__version__} lacks torch.ops.symm_mem.all_to_all_vdev_2d")
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        nvshmem = symm_mem.is_nvshmem_available()
    except (ImportError, RuntimeError) as error:
        problems.append(f"torch.distributed._symmetric_memory is not usable: {error}")
    else:
        if not nvshmem:
            problems.append("NVSHMEM is not available (is_nvshmem_available() is False)")
    return tuple(problems)
