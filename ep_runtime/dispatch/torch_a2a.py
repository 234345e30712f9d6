"""torch.distributed ``all_to_all_single`` dispatcher (gloo on CPU, NCCL on GPU).

Rows move as described in ``rows.py`` (packed once per (token, destination rank), expanded and
pre-reduced on the receiver, summed in fp32 on the source).

exact: a header all-to-all (status, chunk count, K, rows, per-expert counts) then the rows with
uneven splits; one host sync per forward. capacity: header + rows packed in one
``[W, 1 + cap, row_bytes]`` buffer, one all-to-all per direction, no host sync on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch

from ep_runtime.dispatch.base import (
    DISPATCHERS,
    NUM_CHUNKS,
    STATUS,
    TOP_K,
    DispatcherCapabilities,
    ForwardStatus,
    Pending,
)
from ep_runtime.dispatch.rows import HEADER_FIELDS, NUM_ROWS, Route, RowDispatcher
from ep_runtime.expand import count_per_expert
from ep_runtime.types import (
    Dispatched,
    DispatchMode,
    TopkLayout,
)


@dataclass
class _ExactHandle:
    send_counts: list[int]  # rows this rank sent to each rank
    recv_counts: list[int]  # rows this rank received from each rank
    combine_positions: torch.Tensor  # [T, J] int64 rows of the combine receive buffer per token
    expand_positions: torch.Tensor | None  # [R, K] grouped row per (row, slot), EXPANDED only


@dataclass
class _CapacityHandle:
    combine_positions: torch.Tensor  # [T, J] into the flat [W * cap] combine receive buffer
    expand_positions: torch.Tensor | None


@DISPATCHERS.register
class TorchAllToAll(RowDispatcher):
    """The portable dispatcher: runs anywhere torch.distributed does, any world size."""

    name = "torch_a2a"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
    )
    auto_priority = 0

    # ----------------------------------------------------------------- exact mode
    def _exact_header(
        self,
        status: ForwardStatus,
        num_local_chunks: int,
        top_k: int,
        route: Route | None,
        topk_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """``[W, 4 + L]`` int64: status, chunks, K, rows to that rank, rows per expert there."""
        world, device = self.comm.world_size, self.comm.device
        header = torch.zeros(
            world, HEADER_FIELDS + self.num_local, dtype=torch.int64, device=device
        )
        header[:, STATUS] = int(status)
        header[:, NUM_CHUNKS] = num_local_chunks
        header[:, TOP_K] = top_k
        if route is not None and topk_ids is not None:
            num_experts = self.placement.num_experts
            ids = topk_ids.to(torch.int64)
            per_expert = count_per_expert(ids.masked_fill(ids < 0, num_experts), num_experts)
            header[:, NUM_ROWS] = route.send_counts
            header[:, HEADER_FIELDS:] = per_expert.view(world, self.num_local)
        return header

    def _exchange_exact_header(self, header: torch.Tensor) -> tuple[list[int], list[list[int]]]:
        """The header all-to-all and the forward's one host sync.

        Returns (rows this rank sends to each rank, each source rank's header)."""
        received = torch.empty_like(header)
        self.comm.all_to_all_single(received, header)
        world, width = header.shape
        host = torch.cat([header[:, NUM_ROWS], received.reshape(-1)]).tolist()
        return host[:world], [
            host[world + r * width : world + (r + 1) * width] for r in range(world)
        ]

    def _dispatch_exact(self, x, topk_ids, topk_weights, layout, num_local_chunks) -> Dispatched:
        route = self._route(topk_ids)
        own_k = route.top_k if x.size(0) else 0  # a rank with no tokens agrees with any K
        header = self._exact_header(ForwardStatus.OK, num_local_chunks, own_k, route, topk_ids)
        send_counts, headers = self._exchange_exact_header(header)
        num_chunks = self.peer_status.raise_on_host(headers, own_k)
        top_k = max(h[TOP_K] for h in headers) or route.top_k  # the K the senders used
        recv_counts = [h[NUM_ROWS] for h in headers]
        expert_counts = [sum(h[HEADER_FIELDS + e] for h in headers) for e in range(self.num_local)]
        total_send = sum(send_counts)
        pairs = torch.nonzero_static(route.mask.t(), size=total_send)  # [S, 2] (rank, token)
        packed = self.codec.pack(x, topk_ids.to(torch.int32), topk_weights)
        send_rows = packed.index_select(0, pairs[:, 1])
        recv_rows = torch.empty(
            sum(recv_counts), self.codec.row_bytes, dtype=torch.uint8, device=x.device
        )
        self.comm.all_to_all_single(recv_rows, send_rows, recv_counts, send_counts)
        hidden, ids, weights = self.codec.unpack(recv_rows, top_k)
        dispatched, positions = self._received(
            hidden, ids, weights, None, layout, sum(expert_counts), expert_counts
        )
        rank_base = route.send_counts.cumsum(0) - route.send_counts  # first row sent to each rank
        dispatched.handle = _ExactHandle(
            send_counts=send_counts,
            recv_counts=recv_counts,
            combine_positions=self._positions_or_trash(
                self._combine_positions(route, rank_base), total_send
            ),
            expand_positions=positions,
        )
        dispatched.num_chunks = num_chunks
        return dispatched

    def _combine_exact(
        self, expert_output: torch.Tensor, dispatched: Dispatched, out: torch.Tensor | None
    ) -> torch.Tensor:
        handle: _ExactHandle = dispatched.handle
        send_back = self._pre_reduce(
            expert_output, dispatched, handle.expand_positions
        ).contiguous()
        received = torch.empty(
            sum(handle.send_counts),
            self.setup.hidden_size,
            dtype=self.setup.dtype,
            device=send_back.device,
        )
        if self.setup.poison:
            received.fill_(float("nan"))
        self.comm.all_to_all_single(received, send_back, handle.send_counts, handle.recv_counts)
        return self._finish(received, handle.combine_positions, out)

    # ----------------------------------------------------------------- capacity mode
    def _capacity_send(
        self, route: Route | None, packed: torch.Tensor | None, status: ForwardStatus, top_k: int
    ) -> torch.Tensor:
        """``[W, 1 + cap, row_bytes]``: a header row then the rows for each destination."""
        world, cap, device = self.comm.world_size, self.setup.max_tokens_per_rank, self.comm.device
        row_bytes = self.codec.row_bytes
        send = torch.zeros(world, 1 + cap, row_bytes, dtype=torch.uint8, device=device)
        header = torch.zeros(world, HEADER_FIELDS, dtype=torch.int32, device=device)
        header[:, STATUS] = int(status)
        header[:, NUM_CHUNKS] = 1
        header[:, TOP_K] = top_k
        if route is not None and packed is not None:
            header[:, NUM_ROWS] = route.send_counts.to(torch.int32)
            num_tokens = packed.size(0)
            token_of_slot = torch.full(
                (world, cap + 1), num_tokens, dtype=torch.int64, device=device
            )
            slot = torch.where(route.mask, route.slot, torch.full_like(route.slot, cap))
            tokens = torch.arange(num_tokens, device=device).unsqueeze(1).expand(-1, world)
            token_of_slot.scatter_(1, slot.t(), tokens.t())
            padded = torch.cat([packed, packed.new_zeros(1, row_bytes)])
            send[:, 1:] = padded.index_select(0, token_of_slot[:, :cap].reshape(-1)).view(
                world, cap, row_bytes
            )
        send[:, 0, : 4 * HEADER_FIELDS] = header.view(torch.uint8)
        return send

    def _capacity_exchange(self, send: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recv = torch.empty_like(send)
        self.comm.all_to_all_single(
            recv.view(-1, self.codec.row_bytes), send.view(-1, self.codec.row_bytes)
        )
        header = recv[:, 0, : 4 * HEADER_FIELDS].contiguous().view(torch.int32)  # [W, 4]
        return recv[:, 1:], header

    def _dispatch_capacity(self, x, topk_ids, topk_weights, layout) -> Dispatched:
        world, cap = self.comm.world_size, self.setup.max_tokens_per_rank
        route = self._route(topk_ids)
        packed = self.codec.pack(x, topk_ids.to(torch.int32), topk_weights)
        rows, header = self._capacity_exchange(
            self._capacity_send(route, packed, ForwardStatus.OK, route.top_k)
        )
        if self.host_reads_free:
            self.peer_status.raise_on_host(header.tolist(), route.top_k)
        else:
            self.peer_status.record_on_device(header, route.top_k)
        recv_counts = header[:, NUM_ROWS].to(torch.int64)
        row_valid = (
            torch.arange(cap, device=x.device).unsqueeze(0) < recv_counts.unsqueeze(1)
        ).reshape(-1)
        hidden, ids, weights = self.codec.unpack(rows.reshape(world * cap, -1), route.top_k)
        expanded_rows = world * cap * min(route.top_k, self.num_local)
        dispatched, positions = self._received(
            hidden, ids, weights, row_valid, layout, expanded_rows, None
        )
        rank_base = torch.arange(world, device=x.device) * cap
        dispatched.handle = _CapacityHandle(
            combine_positions=self._positions_or_trash(
                self._combine_positions(route, rank_base), world * cap
            ),
            expand_positions=positions,
        )
        return dispatched

    def _combine_capacity(self, expert_output, dispatched, out) -> torch.Tensor:
        handle: _CapacityHandle = dispatched.handle
        send_back = self._pre_reduce(
            expert_output, dispatched, handle.expand_positions
        ).contiguous()
        received = torch.empty_like(send_back)
        if self.setup.poison:
            received.fill_(float("nan"))
        self.comm.all_to_all_single(received, send_back)
        return self._finish(received, handle.combine_positions, out)

    # ----------------------------------------------------------------- protocol
    def dispatch_async(
        self, x, topk_ids, topk_weights, layout, *, num_local_chunks=1
    ) -> Pending[Dispatched]:
        self._check_open()
        if self.setup.mode is DispatchMode.EXACT:
            return Pending.completed(
                self._dispatch_exact(x, topk_ids, topk_weights, layout, num_local_chunks)
            )
        return Pending.completed(self._dispatch_capacity(x, topk_ids, topk_weights, layout))

    def combine_async(self, expert_output, dispatched, out=None) -> Pending[torch.Tensor]:
        self._check_open()
        if isinstance(dispatched.handle, _ExactHandle):
            return Pending.completed(self._combine_exact(expert_output, dispatched, out))
        return Pending.completed(self._combine_capacity(expert_output, dispatched, out))

    def abort(self, error: BaseException, layout: TopkLayout) -> NoReturn:
        """Carry ``error``'s status through this forward's first collective, then raise it.

        exact, or capacity on CPU: peers read the status at once and raise naming this rank.
        capacity on CUDA (no host sync): also take part in the combine, so peers finish the
        forward; they raise at their next ``check()``."""
        self._check_open()
        status, top_k = ForwardStatus.of(error), self.setup.max_top_k
        if self.setup.mode is DispatchMode.EXACT:
            _, headers = self._exchange_exact_header(
                self._exact_header(status, 1, top_k, None, None)
            )
        else:
            _, header = self._capacity_exchange(self._capacity_send(None, None, status, top_k))
            headers = header.tolist() if self.host_reads_free else None
        if headers is not None:  # every rank reads the statuses now: all raise together
            self.peer_status.raise_on_host(headers, top_k, error)
        world, cap = self.comm.world_size, self.setup.max_tokens_per_rank
        zeros = torch.zeros(
            world * cap, self.setup.hidden_size, dtype=self.setup.dtype, device=self.comm.device
        )
        self.comm.all_to_all_single(torch.empty_like(zeros), zeros)  # the combine peers will run
        raise error
