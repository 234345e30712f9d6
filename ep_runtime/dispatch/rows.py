"""The packed-row transport shared by the dispatchers that move whole rows with an all-to-all.

Wire format (``kernels/layout.py``): a token travels once to each rank owning at least one of its
experts, as one byte row ``hidden | ids int32 [K_max] | weights fp32 [K_max]``, in per-peer
chunks of header rows then token rows (with fp8 block-scaled experts the hidden part is the
contract's ``q(x)``: e4m3 values and fp32 scales per 128 columns, quantized in pack, handed to
the experts as they arrive; combine stays in the compute dtype). The receiver keeps the slots
it serves and, for EXPANDED, regroups one row per (token, local expert), ordered by (expert,
source rank, token). Before sending back it pre-reduces a token's local rows in fp32 into the
row the token arrived in, and writes its status into each chunk's header; the source sums a
token's per-rank results in fp32 in rank order (no atomics: two runs are bitwise equal).

exact: chunks are sized from the headers (one host read per forward, plus one for the combine
statuses); capacity: every chunk holds ``cap`` token rows, nothing is read on the host on CUDA.
Alone (a world of one) nothing is exchanged: the buffers have their static sizes and no status
travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.dispatch.base import Dispatcher
from ep_runtime.dispatch.protocol import Agreed, Phase
from ep_runtime.dispatch.setup import DispatchSetup, PeerSetup
from ep_runtime.kernels import KernelOps, Route
from ep_runtime.kernels.layout import ChunkLayout, RowFormat, header_rows_for
from ep_runtime.placement import LocalExperts
from ep_runtime.types import Dispatched, DispatchMode, TopkLayout


def group_for_experts(
    ops: KernelOps,
    row_format: RowFormat,
    payload: torch.Tensor,  # [R, H] hidden states, or (quantized) ``row_format.payload_words``
    ids: torch.Tensor,  # [R, K] int32 global ids, -1 = unused
    weights: torch.Tensor,  # [R, K] fp32
    local: LocalExperts,
    num_rows: int,  # grouped rows to make room for: at least the served (row, slot) pairs
    poison: bool,
) -> tuple[Dispatched, torch.Tensor]:
    """EXPANDED: one row per served (row, slot) pair, grouped by local expert (quantized rows:
    e4m3 values and scales regrouped together, bit for bit); and ``[R, K]`` int32 the grouped
    row of each (row, slot), which the combine's pre-reduce reads."""
    grouped = ops.group_rows(
        payload,
        ids,
        weights,
        local_offset=local.offset,
        num_local=local.count,
        num_rows=num_rows,
        poison=poison,
    )
    hidden, scale = grouped.hidden, None
    if row_format.quantized:
        hidden, scale = row_format.split_payload(grouped.hidden)
    dispatched = Dispatched(
        hidden,
        grouped.ids.unsqueeze(1),
        grouped.weights.unsqueeze(1),
        TopkLayout.EXPANDED,
        grouped.offsets,
        hidden_states_scale=scale,
    )
    return dispatched, grouped.positions


@dataclass(frozen=True)
class RowPacked:
    route: Route
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


class RowDispatcher(Dispatcher[RowPacked, RowHandle, torch.Tensor]):
    """Packed rows over ``comm.all_to_all``. A subclass may move the bytes another way
    (``_exchange``), from buffers of its own (``_new_buffer``), and choose the chunk layout
    (``chunks``): exact mode sizes buffers from the headers, capacity mode from the cap."""

    def __init__(self, setup: DispatchSetup, peer_setup: PeerSetup) -> None:
        super().__init__(setup, peer_setup)
        self.row_format = RowFormat(
            setup.hidden_size,
            setup.dtype,
            setup.max_top_k,
            quantized=setup.quantization is not None,
        )
        capacity = None if setup.mode is DispatchMode.EXACT else setup.max_tokens_per_rank
        self.chunks = ChunkLayout(header_rows_for(setup.hidden_size, setup.dtype), capacity)
        self.local = self.placement.local

    # ----------------------------------------------------------------- dispatch
    def _pack(self, x: torch.Tensor, topk_weights: torch.Tensor, route: Route) -> RowPacked:
        """The send buffer has room for the most rows this rank can send; rows past its chunks
        are filler (ids -1)."""
        world, top_k = self.comm.world_size, route.ids.size(1)
        if self.setup.mode is DispatchMode.EXACT:
            bound = world * self.chunks.header_rows + x.size(0) * min(top_k, world)
        else:
            bound = world * (self.chunks.header_rows + self.setup.max_tokens_per_rank)
        send = self._new_buffer(Phase.DISPATCH, bound)
        self.ops.pack_rows(
            x, topk_weights, route, send, self.row_format, self.chunks, poison=self.setup.poison
        )
        return RowPacked(route, send)

    def _exchange_dispatch(
        self, packed: RowPacked, agreed: Agreed, layout: TopkLayout
    ) -> tuple[Dispatched, RowHandle]:
        send, top_k = packed.send, agreed.top_k
        send_splits = recv_splits = None
        if agreed.sizes is not None:  # exact sizes, read from the headers
            send_splits = self.chunks.chunk_rows(agreed.sizes.send_rows)
            recv_splits = self.chunks.chunk_rows(agreed.sizes.recv_rows)
            grouped_rows = agreed.sizes.served_slots
            send, recv_total = send[: sum(send_splits)], sum(recv_splits)
        else:  # static sizes: as many rows as were sent
            recv_total = send.size(0)
            grouped_rows = recv_total * min(top_k, self.local.count)
        recv = self._exchange(Phase.DISPATCH, send, agreed.sent_rows, send_splits, recv_splits)
        row_format = self.row_format
        hidden = row_format.hidden(recv)  # [R, H] views into the received bytes
        scale = row_format.scales(recv) if row_format.quantized else None  # [R, H/128]
        ids = row_format.ids(recv, top_k)
        weights = row_format.weights(recv, top_k)
        if layout is TopkLayout.STANDARD:
            served = self.ops.local_ids(
                ids, local_offset=self.local.offset, num_local=self.local.count
            )
            dispatched = Dispatched(
                hidden, served, weights, layout, None, hidden_states_scale=scale
            )
            positions = None
        else:
            dispatched, positions = group_for_experts(
                self.ops,
                row_format,
                row_format.payload_words(recv) if row_format.quantized else hidden,
                ids,
                weights,
                self.local,
                grouped_rows,
                self.setup.poison,
            )
        handle = RowHandle(
            packed.route,
            agreed.sent_rows,
            agreed.received_rows,
            send_splits,
            recv_splits,
            recv_total,
            grouped_positions=positions,
        )
        return dispatched, handle

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
        return self.comm.all_to_all(send, send_splits=send_splits, recv_splits=recv_splits)

    # ----------------------------------------------------------------- combine
    def _exchange_combine(
        self,
        expert_output: torch.Tensor | None,
        dispatched: Dispatched,
        handle: RowHandle,
        status: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-reduce, then send each received row's result back to its source, the status
        in every chunk's header."""
        if expert_output is None:
            back = self._new_buffer(Phase.COMBINE, handle.recv_total).zero_()
        elif handle.grouped_positions is None:  # STANDARD: one result row per received row
            back = expert_output.contiguous()
        else:  # EXPANDED: pre-reduce each received row's local results in fp32
            back = self._new_buffer(Phase.COMBINE, handle.recv_total)
            self.ops.sum_rows(expert_output, handle.grouped_positions, back)
        if status is None:  # no peer takes part: the results are already where they sum
            return back, None
        self.ops.write_chunk_headers(back, status, handle.received_rows, self.chunks)
        returned = self._exchange(
            Phase.COMBINE, back, handle.received_rows, handle.recv_splits, handle.send_splits
        )
        return returned, self.ops.read_chunk_headers(returned, handle.sent_rows, self.chunks)

    def _reduce(
        self,
        returned: torch.Tensor,
        handle: RowHandle,
        out: torch.Tensor | None,
        failed: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.ops.sum_rows(
            returned,
            handle.route.dest_slot,
            out,
            chunk_counts=handle.sent_rows,
            chunks=self.chunks,
            failed=failed,
        )
