"""The packed-row transport shared by the dispatchers that move whole rows with an all-to-all.

Wire format (``kernels/layout.py``): a token travels once to each rank owning at least one of its
experts, as one byte row ``hidden | ids int32 [K_max] | weights fp32 [K_max]``, in per-peer
chunks of header rows then token rows. The receiver keeps the slots it serves and, for EXPANDED,
regroups one row per (token, local expert), ordered by (expert, source rank, token). Before
sending back it pre-reduces a token's local rows in fp32 into the row the token arrived in, and
writes its status into each chunk's header; the source sums a token's per-rank results in fp32 in
rank order (no atomics: two runs are bitwise equal).

exact: chunks are sized from the headers (one host read per forward, plus one for the combine
statuses); capacity: every chunk holds ``cap`` token rows, nothing is read on the host on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.dispatch.base import Dispatcher, DispatchSetup, PeerSetup
from ep_runtime.dispatch.protocol import Outcome, Phase
from ep_runtime.kernels import (
    HeaderFields,
    Route,
    group_rows,
    local_ids,
    pack_rows,
    read_chunk_headers,
    sum_rows,
    write_chunk_headers,
)
from ep_runtime.kernels.layout import (
    ChunkLayout,
    Field,
    RowFormat,
    header_rows_for,
)
from ep_runtime.types import Dispatched, DispatchMode, TopkLayout


@dataclass(frozen=True)
class RowPlan:
    top_k: int  # K of this rank's ids
    route: Route
    header_pair: torch.Tensor  # [2, W, HEADER_INTS] int32: sent, received
    send: torch.Tensor  # [S_max, row_bytes] uint8, packed


@dataclass(frozen=True)
class RowHandle:
    """What combine needs of a dispatch."""

    route: Route  # dest_slot: where this rank's tokens went
    sent_rows: torch.Tensor  # [W] int32 token rows sent to each rank (combine's receive chunks)
    received_rows: torch.Tensor  # [W] int32 token rows received from each (combine's send chunks)
    send_splits: list[int] | None  # exact mode: rows of each dispatch send chunk
    recv_splits: list[int] | None  # exact mode: rows of each dispatch receive chunk
    recv_total: int  # rows of the dispatch receive buffer
    grouped_positions: torch.Tensor | None  # [R, K] int32 grouped row of each (row, slot)


class RowDispatcher(Dispatcher):
    """Packed rows over ``peers.all_to_all``. A subclass may move the bytes another way
    (``_exchange``), from buffers of its own (``_new_buffer``), and choose the chunk layout
    (``chunks``): exact mode sizes buffers from the headers, capacity mode from the cap."""

    def __init__(self, setup: DispatchSetup, peer_setup: PeerSetup) -> None:
        super().__init__(setup, peer_setup)
        self.row_format = RowFormat(setup.hidden_size, setup.dtype, setup.max_top_k)
        capacity = None if setup.mode is DispatchMode.EXACT else setup.max_tokens_per_rank
        self.chunks = ChunkLayout(header_rows_for(setup.hidden_size, setup.dtype), capacity)
        self.num_local = self.placement.num_local_experts
        self.local_offset = self.placement.local_expert_offset

    # ----------------------------------------------------------------- dispatch
    def _plan(self, x, topk_ids, topk_weights, fields: HeaderFields) -> RowPlan:
        """Route and pack before the header exchange (nothing here waits for the host): the
        send buffer has room for the most rows this rank can send; rows past its chunks are
        filler (ids -1)."""
        world = self.comm.world_size
        route, header_pair = self._route(topk_ids, fields)
        top_k = topk_ids.size(1)
        if self.setup.mode is DispatchMode.EXACT:
            bound = world * self.chunks.header_rows + x.size(0) * min(top_k, world)
        else:
            bound = world * (self.chunks.header_rows + self.setup.max_tokens_per_rank)
        send = self._new_buffer(Phase.DISPATCH, bound)
        pack_rows(
            x, topk_weights, route, send, self.row_format, self.chunks, poison=self.setup.poison
        )
        return RowPlan(top_k, route, header_pair, send)

    def _send(self, plan: RowPlan, layout: TopkLayout, outcome: Outcome) -> Dispatched:
        world, chunks = self.comm.world_size, self.chunks
        sent_rows = plan.header_pair[0, :, Field.NUM_ROWS]
        received_rows = plan.header_pair[1 if world > 1 else 0, :, Field.NUM_ROWS]
        send = plan.send
        send_splits = recv_splits = None
        top_k = plan.top_k
        if outcome.sent is not None and self.setup.mode is DispatchMode.EXACT:
            assert outcome.received is not None  # exact sizes, read from the headers
            send_splits = chunks.chunk_rows([row[Field.NUM_ROWS] for row in outcome.sent])
            recv_splits = chunks.chunk_rows([row[Field.NUM_ROWS] for row in outcome.received])
            top_k = max(row[Field.TOP_K] for row in outcome.received) or top_k
            grouped_rows = sum(row[Field.NUM_SLOTS] for row in outcome.received)
            send, recv_total = send[: sum(send_splits)], sum(recv_splits)
        else:  # static sizes: capacity mode, or a world of one (nothing to exchange)
            recv_total = send.size(0)
            grouped_rows = recv_total * min(top_k, self.num_local)
        recv = self._exchange(Phase.DISPATCH, send, sent_rows, send_splits, recv_splits)
        hidden = self.row_format.hidden(recv)  # [R, H] views into the received bytes
        ids = self.row_format.ids(recv, top_k)
        weights = self.row_format.weights(recv, top_k)
        handle_fields = dict(
            route=plan.route,
            sent_rows=sent_rows,
            received_rows=received_rows,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_total=recv_total,
        )
        if layout is TopkLayout.STANDARD:
            served = local_ids(ids, local_offset=self.local_offset, num_local=self.num_local)
            handle = RowHandle(grouped_positions=None, **handle_fields)
            return Dispatched(hidden, served, weights, layout, None, handle)
        grouped = group_rows(
            hidden,
            ids,
            weights,
            local_offset=self.local_offset,
            num_local=self.num_local,
            num_rows=grouped_rows,
            poison=self.setup.poison,
        )
        handle = RowHandle(grouped_positions=grouped.positions, **handle_fields)
        return Dispatched(
            grouped.hidden,
            grouped.ids.unsqueeze(1),
            grouped.weights.unsqueeze(1),
            layout,
            grouped.offsets,
            handle,
        )

    def _new_buffer(self, phase: Phase, rows: int) -> torch.Tensor:
        """A send buffer of ``rows`` rows, every one of which the caller writes: dispatch
        ``[rows, row_bytes]`` uint8, combine ``[rows, H]`` compute dtype."""
        device = self.comm.device
        if phase is Phase.DISPATCH:
            return torch.empty(rows, self.row_format.row_bytes, dtype=torch.uint8, device=device)
        return torch.empty(rows, self.setup.hidden_size, dtype=self.setup.dtype, device=device)

    def _exchange(
        self,
        phase: Phase,
        send: torch.Tensor,  # [S, width] per-peer chunks in ``self.chunks`` layout
        rows_per_peer: torch.Tensor,  # [W] int32 token rows of each send chunk (on the device)
        send_splits: list[int] | None,  # exact mode: rows of each send chunk
        recv_splits: list[int] | None,  # exact mode: rows of each receive chunk
    ) -> torch.Tensor:
        """Move the chunks of one phase; returns the received chunks."""
        return self.peers.all_to_all(send, send_splits=send_splits, recv_splits=recv_splits)

    # ----------------------------------------------------------------- combine
    def _return(
        self,
        expert_output: torch.Tensor | None,
        dispatched: Dispatched,
        handle: RowHandle,
        status_header: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if expert_output is None:
            back = self._new_buffer(Phase.COMBINE, handle.recv_total).zero_()
        elif handle.grouped_positions is None:  # STANDARD: one result row per received row
            back = expert_output.contiguous()
        else:  # EXPANDED: pre-reduce each received row's local results in fp32
            back = self._new_buffer(Phase.COMBINE, handle.recv_total)
            sum_rows(expert_output, handle.grouped_positions, back)
        if self.comm.world_size == 1:
            return back, status_header.unsqueeze(0)
        write_chunk_headers(back, status_header, handle.received_rows, self.chunks)
        returned = self._exchange(
            Phase.COMBINE, back, handle.received_rows, handle.recv_splits, handle.send_splits
        )
        return returned, read_chunk_headers(returned, handle.sent_rows, self.chunks)

    def _finish(
        self,
        returned: torch.Tensor,
        handle: RowHandle,
        out: torch.Tensor | None,
        failed: torch.Tensor | None,
    ) -> torch.Tensor:
        return sum_rows(
            returned,
            handle.route.dest_slot,
            out,
            chunk_counts=handle.sent_rows,
            chunks=self.chunks,
            failed=failed,
        )
