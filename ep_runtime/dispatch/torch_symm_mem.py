"""torch NVSHMEM symmetric-memory dispatcher: sync-free all-to-all with splits on the device.

NEVER RUN: written on a CPU machine for a later session with 2-8 H200s. Its adapter logic is
tested against an imitation of the two ops (tests/test_symm_mem_dispatcher.py); the real ops have
not run once. ``auto_priority = -1``, so ``dispatcher="auto"`` never picks it until the multi-rank
suite has passed with it on hardware (scripts/multigpu_bench.sh runs that suite).

What the ops do, as relied on here (PyTorch source; torch 2.11 on the GPU machine has both ops,
/work/shared/DEVICE.md "Torch symmetric memory there"):
- Schemas (``TORCH_LIBRARY(symm_mem, ...)`` under torch/csrc/distributed/c10d/symm_mem/; the
  same in the local torch 2.13's ``torch.ops.symm_mem.*.default._schema``):
  ``all_to_all_vdev_2d(Tensor input, Tensor(a!) out, Tensor in_splits,
  Tensor(a!) out_splits_offsets, str group_name, int? major_align=None)`` and
  ``all_to_all_vdev_2d_offset(Tensor input, Tensor(a!) out, Tensor in_splits_offsets,
  Tensor(a!) out_splits_offsets, str group_name)``.
- ``all_to_all_vdev_2d`` (nvshmem_extension.cu, pytorch/pytorch 0047056e and 902cfc0e): "a
  transpose from rank-major order at input to expert-major order at output". ``in_splits``
  ``[W·ne]`` int64 is rank-major (index ``d·ne + e``); ``out_splits_offsets`` ``[2, W·ne]`` int64
  gets the splits and exclusive offsets in expert-major order (index ``e·W + src``). Each expert's
  group is aligned up to ``major_align`` (default 1) and "In case aligned_len is 0, we set it to
  major_align ... cutlass currently does not support empty bins": an empty group still takes
  ``major_align`` rows. test/distributed/test_nvshmem.py ``test_all_to_all_vdev_2d`` checks the
  same ("last element absorbs the padding").
- ``all_to_all_vdev_2d_offset``: "can be viewed as an 'reverse' operation to the
  all_to_all_vdev_2d"; input splits and offsets ``[2, ne·W]`` expert-major, "paddings are allowed
  between the split chunks ... will not be transferred"; output rank-major, offsets an exclusive
  scan. PyTorch's own autograd helper ``AllToAllVDev2d`` passes the forward's
  ``out_splits_offsets`` as this op's ``in_splits_offsets`` in its backward, which is what
  combine does here; test_nvshmem.py ``test_all_to_all_vdev_2d_offset`` checks the layout.
- Every tensor argument is rendezvoused inside the op, so all four must come from
  ``symm_mem.empty`` with identical shapes on every rank; ``set_backend("NVSHMEM")`` must precede
  the first allocation; the tests ``dist.barrier()`` after allocating "to ensure remote tensors
  are allocated". The data kernel pulls (``nvshmemx_getmem``) from peers' inputs.
- Limits (TORCH_CHECKs in the same file): ``ne <= 16`` and ``W <= 32`` for the 2-D op,
  ``W <= 16`` and ``ne <= 32`` for the offset op; splits and offsets int64; input and out the
  same dtype and row stride.

Why the wire is per (token, rank) and not one row per (token, expert): with ``ne = L`` the 2-D
op would hand grouped_mm its expert-major rows directly, but ``ne <= 16`` rejects DeepSeek-V3 at
EP <= 8 (L = 32..128), and it would move one row per (token, local expert): about 2x the NVLink
bytes for DeepSeek-V3 at EP8 (group-limited routing puts ~2 of a token's 8 experts on each rank
it reaches) and no pre-reduced combine. So the op runs with two "experts" per rank: bucket 0
carries one header row per (source, destination) (status, chunk count, K, rows), bucket 1 the
token rows, each token once per rank that owns one of its experts (DESIGN.md "Wire format"). With
``major_align=1`` the received headers sit at rows ``[0, W)`` and the token rows, packed by
source, from row W. The receiver keeps its slots and expands exactly like torch_a2a (same code:
``RowDispatcher``'s row codec and receive/reduce steps, rows.py), so EXPANDED output is
expert-major and goes to grouped_mm without a host sync. Combine pre-reduces each received row's
local slots in fp32, sends one row per (token, rank) back with ``all_to_all_vdev_2d_offset``
using the dispatch's ``out_splits_offsets``, and the source sums its rows in fp32 (no atomics):
the results land at the rows the source sent its tokens from.

Buffers: two slots (a ``Dispatched`` lives until its combine; two may be in flight), each with
send/receive buffers of ``W·(1 + cap)`` rows for both directions. Reuse is safe because every op
starts with an NVSHMEM barrier across the group: a slot's buffers are written again only two ops
later, after every peer finished pulling from them. exact mode: one host read after the op
(headers, received count, per-expert counts). capacity mode: no host read; peers' statuses are
recorded on the device and raised by ``check()``. NVLink multicast stays off
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``; a different value is a
refusal).

Unverified until it runs: that torch 2.11's ops match the source quoted above (exact mode checks
where the token rows landed and raises if not); that ``symm_mem.get_backend`` exists there; that
``NVSHMEM_SYMMETRIC_SIZE`` (set here to the slots' size if unset; NVSHMEM's default heap is
1 GiB, DeepSeek-V3 at EP8 and 4096 tokens needs about 3.8 GiB) is read at NVSHMEM's start; and
the packing cost: one gather of ``W + T·min(K, W)`` rows into the send buffer per dispatch.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.dispatch.base import (
    DISPATCHERS,
    NUM_CHUNKS,
    STATUS,
    TOP_K,
    DispatcherCapabilities,
    DispatchSetup,
    ForwardStatus,
    Pending,
)
from ep_runtime.dispatch.rows import HEADER_FIELDS, NUM_ROWS, Route, RowDispatcher
from ep_runtime.expand import count_per_expert
from ep_runtime.experts.base import local_expert_index
from ep_runtime.types import Dispatched, DispatchMode, EPInputError, TopkLayout

MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HEAP_SIZE_ENV = "NVSHMEM_SYMMETRIC_SIZE"  # NVSHMEM's symmetric heap; 1 GiB by default
HEAP_MARGIN_BYTES = 256 << 20
MAX_WORLD_SIZE = 16  # all_to_all_vdev_2d_offset: world_size <= NUM_TILES (512 threads / 32)
NUM_BUCKETS = 2  # the op's "experts" per rank: 0 = header row, 1 = token rows
HEADER_BUCKET, TOKEN_BUCKET = 0, 1
NUM_SLOTS = 2  # Dispatched objects that may be in flight at once


# ------------------------------------------------------------------- pure tensor steps
def split_table(send_counts: torch.Tensor) -> torch.Tensor:
    """``[W·2]`` int64 ``in_splits``, rank-major: per destination 1 header row, then its tokens."""
    counts = send_counts.to(torch.int64)
    return torch.stack([torch.ones_like(counts), counts], dim=1).reshape(-1)


def first_token_rows(send_counts: torch.Tensor) -> torch.Tensor:
    """``[W]`` int64: send-buffer row of each destination's first token row (its header is the
    row before). The offset op returns rows to the same positions, so this indexes combine too."""
    chunk = send_counts.to(torch.int64) + 1  # header + tokens per destination
    return chunk.cumsum(0) - chunk + 1


def send_row_sources(route: Route, first_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows]`` int64: the row of ``[tokens T | headers W | zero row]`` each send row copies.

    Rows past the packed total copy the zero row (the op never reads them). No host sync.
    """
    num_tokens, world = route.mask.shape
    device = route.mask.device
    table = torch.full((num_rows + 1,), num_tokens + world, dtype=torch.int64, device=device)
    positions = torch.where(route.mask, first_rows.unsqueeze(0) + route.slot, num_rows)  # [T, W]
    tokens = torch.arange(num_tokens, device=device).unsqueeze(1).expand(num_tokens, world)
    table.scatter_(0, positions.reshape(-1), tokens.reshape(-1))
    table.scatter_(0, first_rows - 1, torch.arange(world, device=device) + num_tokens)
    return table[:num_rows]


def header_rows(
    status: ForwardStatus,
    num_local_chunks: int,
    top_k: int,
    send_counts: torch.Tensor,
    row_bytes: int,
) -> torch.Tensor:
    """``[W, row_bytes]`` uint8: int32 ``(status, chunks, K, rows to that rank)`` then zeros."""
    world = send_counts.numel()
    header = torch.zeros(world, HEADER_FIELDS, dtype=torch.int32, device=send_counts.device)
    header[:, STATUS] = int(status)
    header[:, NUM_CHUNKS] = num_local_chunks
    header[:, TOP_K] = top_k
    header[:, NUM_ROWS] = send_counts.to(torch.int32)
    rows = torch.zeros(world, row_bytes, dtype=torch.uint8, device=send_counts.device)
    rows[:, : 4 * HEADER_FIELDS] = header.view(torch.uint8)
    return rows


def received_headers(recv: torch.Tensor, world: int) -> torch.Tensor:
    """``[W, 4]`` int32 header from each source: the header bucket fills rows ``[0, W)``."""
    return recv[:world, : 4 * HEADER_FIELDS].contiguous().view(torch.int32)


def received_token_count(splits_offsets: torch.Tensor, world: int) -> torch.Tensor:
    """0-d int64: token rows received from all sources (the op's output splits, token bucket)."""
    return splits_offsets[0, TOKEN_BUCKET * world : (TOKEN_BUCKET + 1) * world].sum()


def token_rows_start(splits_offsets: torch.Tensor, world: int) -> torch.Tensor:
    """0-d int64: where the op put source 0's token rows; W when headers come first unaligned."""
    return splits_offsets[1, TOKEN_BUCKET * world]


# ------------------------------------------------------------------- the transport
class SymmetricTransport(Protocol):
    """Symmetric allocation and the two collectives; tests substitute an imitation."""

    def empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor: ...

    def ready(self) -> None: ...

    def all_to_all_2d(
        self,
        inputs: torch.Tensor,
        out: torch.Tensor,
        in_splits: torch.Tensor,
        out_splits_offsets: torch.Tensor,
    ) -> None: ...

    def all_to_all_2d_offset(
        self,
        inputs: torch.Tensor,
        out: torch.Tensor,
        in_splits_offsets: torch.Tensor,
        out_splits_offsets: torch.Tensor,
    ) -> None: ...


def multicast_problem() -> str | None:
    """A multicast switch set to anything but off (it can take the host's GPUs out of service)."""
    wrong = [f"{k}={os.environ[k]}" for k, v in MULTICAST_OFF.items() if os.environ.get(k, v) != v]
    return f"NVLink multicast must stay off, but {', '.join(wrong)}" if wrong else None


class NvshmemTransport:
    """torch's NVSHMEM symmetric memory on ``comm``'s group (the real ops)."""

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
            symm_mem.set_backend("NVSHMEM")  # global; must precede the first allocation
        self.symm_mem = symm_mem
        self.comm = comm
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

    def all_to_all_2d_offset(self, inputs, out, in_splits_offsets, out_splits_offsets) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(
            inputs, out, in_splits_offsets, out_splits_offsets, self.group_name
        )


@dataclass
class _Slot:
    """One in-flight forward's symmetric buffers; every rank allocates the same shapes."""

    send: torch.Tensor  # [W·(1+cap), row_bytes] uint8, packed rank-major
    recv: torch.Tensor  # [W·(1+cap), row_bytes] uint8: W headers, then token rows by source
    in_splits: torch.Tensor  # [W·2] int64
    splits_offsets: torch.Tensor  # [2, 2·W] int64, dispatch output = combine input
    send_back: torch.Tensor  # [W·(1+cap), H]: pre-reduced rows at the received rows' positions
    recv_back: torch.Tensor  # [W·(1+cap), H]: results at this rank's send-buffer positions
    combine_splits_offsets: torch.Tensor  # [2, 2·W] int64
    owner: weakref.ref | None = field(default=None)  # the Dispatched using it, until combine

    def busy(self) -> bool:
        return self.owner is not None and self.owner() is not None


@dataclass
class _SymmHandle:
    slot: _Slot
    combine_positions: torch.Tensor  # [T, J] rows of recv_back per token; unused = num_send_rows
    expand_positions: torch.Tensor | None  # [R, K] EXPANDED only
    num_send_rows: int  # rows of the send buffer this dispatch filled (static bound)


@DISPATCHERS.register
class TorchSymmMemDispatcher(RowDispatcher):
    """torch_a2a's wire format and receive-side steps on NVSHMEM: no host sync in capacity mode.

    Never run on hardware yet (see the module docstring); "auto" does not pick it.
    """

    name = "torch_symm_mem"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        min_world_size=2,
    )
    auto_priority = -1

    @classmethod
    def refusal(cls, setup: DispatchSetup, layout: TopkLayout | None) -> str | None:
        """Every refusal names the transport (the suite's expected-skip patterns match it)."""
        reason = super().refusal(setup, layout)
        return None if reason is None else f"torch symmetric memory: {reason}"

    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        """Cheap checks (no allocation, no collective, no kernel): well under a second."""
        problems = [*symm_mem_problems()]
        if setup.comm.group is None:
            problems.append("needs an initialised process group of >= 2 GPUs")
        if setup.comm.world_size > MAX_WORLD_SIZE:
            problems.append(
                f"all_to_all_vdev_2d_offset takes at most {MAX_WORLD_SIZE} ranks, "
                f"got {setup.comm.world_size}"
            )
        if (problem := multicast_problem()) is not None:
            problems.append(problem)
        return "; ".join(problems) or None

    @classmethod
    def make_transport(cls, comm: Comm, heap_bytes: int) -> SymmetricTransport:
        return NvshmemTransport(comm, heap_bytes)

    def __init__(self, setup: DispatchSetup) -> None:
        super().__init__(setup)
        world, cap = self.comm.world_size, setup.max_tokens_per_rank
        self.num_rows = world * (1 + cap)  # worst case either way: W headers + W·cap tokens
        element = setup.dtype.itemsize
        slot_bytes = self.num_rows * 2 * (self.codec.row_bytes + setup.hidden_size * element)
        self.transport = self.make_transport(self.comm, NUM_SLOTS * slot_bytes)
        self.slots = [self._allocate_slot() for _ in range(NUM_SLOTS)]
        self.transport.ready()
        self._next_slot = 0

    def _allocate_slot(self) -> _Slot:
        empty, world = self.transport.empty, self.comm.world_size
        rows, hidden, dtype = self.num_rows, self.setup.hidden_size, self.setup.dtype
        return _Slot(
            send=empty(rows, self.codec.row_bytes, dtype=torch.uint8),
            recv=empty(rows, self.codec.row_bytes, dtype=torch.uint8),
            in_splits=empty(world * NUM_BUCKETS, dtype=torch.int64),
            splits_offsets=empty(2, world * NUM_BUCKETS, dtype=torch.int64),
            send_back=empty(rows, hidden, dtype=dtype),
            recv_back=empty(rows, hidden, dtype=dtype),
            combine_splits_offsets=empty(2, world * NUM_BUCKETS, dtype=torch.int64),
        )

    def _take_slot(self) -> _Slot:
        """The next slot, in the same order on every rank (every forward takes exactly one)."""
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % NUM_SLOTS
        if slot.busy():
            raise RuntimeError(
                f"torch_symm_mem: {NUM_SLOTS} dispatches are already waiting for their combine"
            )
        return slot

    # ----------------------------------------------------------------- dispatch
    def _send(
        self,
        slot: _Slot,
        x: torch.Tensor,  # [T, H]
        topk_ids: torch.Tensor,  # [T, K]
        topk_weights: torch.Tensor,  # [T, K]
        status: ForwardStatus,
        num_local_chunks: int,
    ) -> tuple[Route, torch.Tensor, int]:
        """Pack headers and token rows into ``slot.send`` and run the 2-D all-to-all.

        Returns (route, first token row per destination, send rows filled)."""
        world = self.comm.world_size
        route = self._route(topk_ids)
        packed = self.codec.pack(x, topk_ids.to(torch.int32), topk_weights)  # [T, row_bytes]
        headers = header_rows(
            status, num_local_chunks, route.top_k, route.send_counts, self.codec.row_bytes
        )
        sources = torch.cat([packed, headers, packed.new_zeros(1, self.codec.row_bytes)])
        first_rows = first_token_rows(route.send_counts)
        num_send_rows = world + x.size(0) * min(max(route.top_k, 1), world)
        torch.index_select(
            sources,
            0,
            send_row_sources(route, first_rows, num_send_rows),
            out=slot.send[:num_send_rows],
        )
        slot.in_splits.copy_(split_table(route.send_counts))
        self.transport.all_to_all_2d(slot.send, slot.recv, slot.in_splits, slot.splits_offsets)
        return route, first_rows, num_send_rows

    def _read_exact(self, slot: _Slot, top_k: int) -> tuple[list[list[int]], int, list[int]]:
        """The forward's one host sync: (headers per source, token rows received, per-expert
        counts), after checking that the op put the token rows where this adapter expects."""
        world, rows = self.comm.world_size, self.num_rows - self.comm.world_size
        token_rows = slot.recv[world:]  # [W·cap, row_bytes]
        total = received_token_count(slot.splits_offsets, world)
        ids_start = self.codec.hidden_bytes
        ids = token_rows[:, ids_start : ids_start + 4 * self.setup.max_top_k]
        ids = ids.contiguous().view(torch.int32)[:, :top_k]  # [W·cap, K]
        row_valid = torch.arange(rows, device=ids.device) < total
        local = local_expert_index(ids, self.placement)
        local = torch.where(row_valid.unsqueeze(1), local, self.num_local)
        host = torch.cat(
            [
                received_headers(slot.recv, world).reshape(-1).to(torch.int64),
                torch.stack([token_rows_start(slot.splits_offsets, world), total]),
                count_per_expert(local, self.num_local),
            ]
        ).tolist()
        width = world * HEADER_FIELDS
        headers = [host[r * HEADER_FIELDS : (r + 1) * HEADER_FIELDS] for r in range(world)]
        start, received = host[width], host[width + 1]
        if received and start != world:
            raise RuntimeError(
                f"torch_symm_mem: all_to_all_vdev_2d put token rows at row {start}, expected "
                f"{world} (major_align=1 after {world} header rows): the op's layout differs "
                "from the torch source this adapter follows"
            )
        return headers, received, host[width + 2 :]

    def _dispatch_symm(self, x, topk_ids, topk_weights, layout, num_local_chunks) -> Dispatched:
        world, cap = self.comm.world_size, self.setup.max_tokens_per_rank
        if x.size(0) > cap:  # the buffers hold cap rows per rank; EPMoE chunks longer inputs
            self.abort(
                EPInputError("x", f"at most max_tokens_per_rank={cap} rows", x.size(0)), layout
            )
        slot = self._take_slot()
        route, first_rows, num_send_rows = self._send(
            slot, x, topk_ids, topk_weights, ForwardStatus.OK, num_local_chunks
        )
        top_k = route.top_k
        if self.setup.mode is DispatchMode.EXACT:
            headers, received, expert_counts = self._read_exact(slot, top_k)
            num_chunks = self.peer_status.raise_on_host(headers, top_k)
            hidden, ids, weights = self.codec.unpack(slot.recv[world : world + received], top_k)
            dispatched, positions = self._received(
                hidden, ids, weights, None, layout, sum(expert_counts), expert_counts
            )
            dispatched.num_chunks = num_chunks
        else:
            header = received_headers(slot.recv, world)
            if self.host_reads_free:
                self.peer_status.raise_on_host(header.tolist(), top_k)
            else:
                self.peer_status.record_on_device(header, top_k)
            rows = self.num_rows - world
            hidden, ids, weights = self.codec.unpack(slot.recv[world:], top_k)  # [W·cap, ...]
            row_valid = torch.arange(rows, device=x.device) < received_token_count(
                slot.splits_offsets, world
            )
            hidden = torch.where(row_valid.unsqueeze(1), hidden, torch.zeros_like(hidden))
            expanded_rows = rows * min(top_k, self.num_local)
            dispatched, positions = self._received(
                hidden, ids, weights, row_valid, layout, expanded_rows, None
            )
        dispatched.handle = _SymmHandle(
            slot=slot,
            combine_positions=self._positions_or_trash(
                self._combine_positions(route, first_rows), num_send_rows
            ),
            expand_positions=positions,
            num_send_rows=num_send_rows,
        )
        slot.owner = weakref.ref(dispatched)
        return dispatched

    # ----------------------------------------------------------------- combine
    def _return_rows(self, slot: _Slot) -> None:
        """The offset op: ``slot.send_back`` rows go back to the positions they came from."""
        if self.setup.poison:
            slot.recv_back.fill_(float("nan"))
        self.transport.all_to_all_2d_offset(
            slot.send_back, slot.recv_back, slot.splits_offsets, slot.combine_splits_offsets
        )

    def _combine_symm(
        self, expert_output: torch.Tensor, dispatched: Dispatched, out: torch.Tensor | None
    ) -> torch.Tensor:
        handle: _SymmHandle = dispatched.handle
        slot = handle.slot
        if slot.owner is None or slot.owner() is not dispatched:
            raise RuntimeError("torch_symm_mem: this Dispatched was already combined")
        world = self.comm.world_size
        back = self._pre_reduce(expert_output, dispatched, handle.expand_positions)  # [R, H]
        slot.send_back[world : world + back.size(0)].copy_(back)
        self._return_rows(slot)
        result = self._finish(slot.recv_back[: handle.num_send_rows], handle.combine_positions, out)
        slot.owner = None
        return result

    # ----------------------------------------------------------------- protocol
    def dispatch_async(
        self, x, topk_ids, topk_weights, layout, *, num_local_chunks=1
    ) -> Pending[Dispatched]:
        self._check_open()
        return Pending.completed(
            self._dispatch_symm(x, topk_ids, topk_weights, layout, num_local_chunks)
        )

    def combine_async(self, expert_output, dispatched, out=None) -> Pending[torch.Tensor]:
        self._check_open()
        return Pending.completed(self._combine_symm(expert_output, dispatched, out))

    def abort(self, error: BaseException, layout: TopkLayout) -> NoReturn:
        """Send ``error``'s status (and no tokens) through this forward's dispatch, then raise.

        exact, or capacity on CPU: every rank reads the headers at once; peers raise naming this
        rank. capacity on CUDA (no host read): also take part in the combine, so peers finish
        the forward; they raise at their next ``check()``."""
        self._check_open()
        top_k, device = self.setup.max_top_k, self.comm.device
        slot = self._take_slot()
        self._send(
            slot,
            torch.empty(0, self.setup.hidden_size, dtype=self.setup.dtype, device=device),
            torch.empty(0, top_k, dtype=torch.int32, device=device),
            torch.empty(0, top_k, dtype=torch.float32, device=device),
            ForwardStatus.of(error),
            1,
        )
        if self.setup.mode is DispatchMode.EXACT:
            headers, _, _ = self._read_exact(slot, top_k)
            self.peer_status.raise_on_host(headers, top_k, error)
        elif self.host_reads_free:
            header = received_headers(slot.recv, self.comm.world_size)
            self.peer_status.raise_on_host(header.tolist(), top_k, error)
        slot.send_back.zero_()
        self._return_rows(slot)
        raise error

    def close(self) -> None:
        """Drop the symmetric buffers (freed with their last reference)."""
        self.slots = []
        super().close()


@functools.cache
def symm_mem_problems() -> tuple[str, ...]:
    """Why torch's NVSHMEM symmetric memory cannot run in this process (cached)."""
    problems = []
    ops = getattr(torch.ops, "symm_mem", None)
    for op in ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"):
        if ops is None or not hasattr(ops, op):
            problems.append(f"torch {torch.__version__} lacks torch.ops.symm_mem.{op}")
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        nvshmem = symm_mem.is_nvshmem_available()
    except (ImportError, RuntimeError) as error:
        problems.append(f"torch.distributed._symmetric_memory is not usable: {error}")
    else:
        if not nvshmem:
            problems.append("NVSHMEM is not available (is_nvshmem_available() is False)")
    return tuple(problems)
