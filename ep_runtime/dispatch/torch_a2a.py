"""torch.distributed ``all_to_all_single`` dispatcher (gloo on CPU, NCCL on GPU).

Wire format: a token travels once to each rank owning at least one of its experts, as one packed
byte row ``hidden | ids int32 [K_max] | weights fp32 [K_max]``. The receiver keeps the slots it
serves (global ids, -1 elsewhere) and, for EXPANDED, expands one row per (token, local expert).
Before sending back, the receiver pre-reduces a token's local rows in fp32; the source sums the
per-rank rows in fp32 in a fixed order (no atomics: two runs are bitwise equal).

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
    Dispatcher,
    DispatcherCapabilities,
    DispatchSetup,
    ForwardStatus,
    Pending,
)
from ep_runtime.expand import count_per_expert, plan_expansion, sum_rows_fp32
from ep_runtime.types import (
    Dispatched,
    DispatchMode,
    TopkLayout,
)

HEADER_FIELDS = 4  # status, num_chunks, top_k, num_rows (then per-local-expert counts in exact)


def _align(num_bytes: int, alignment: int) -> int:
    return -(-num_bytes // alignment) * alignment


@dataclass(frozen=True)
class RowCodec:
    """Packs ``(hidden, ids, weights)`` rows into aligned byte rows and back."""

    hidden_size: int
    dtype: torch.dtype
    max_top_k: int

    @property
    def hidden_bytes(self) -> int:
        return _align(self.hidden_size * self.dtype.itemsize, 4)

    @property
    def row_bytes(self) -> int:
        return _align(self.hidden_bytes + 8 * self.max_top_k, 16)

    def pack(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[T, row_bytes]`` uint8; slots beyond this call's K carry id -1, weight 0."""
        num_tokens, top_k = ids.shape
        rows = torch.zeros(num_tokens, self.row_bytes, dtype=torch.uint8, device=x.device)
        hidden_end = self.hidden_size * self.dtype.itemsize
        rows[:, :hidden_end] = x.contiguous().view(torch.uint8)
        ids_full = torch.full((num_tokens, self.max_top_k), -1, dtype=torch.int32, device=x.device)
        ids_full[:, :top_k] = ids
        weights_full = torch.zeros(num_tokens, self.max_top_k, dtype=torch.float32, device=x.device)
        weights_full[:, :top_k] = weights
        ids_start = self.hidden_bytes
        weights_start = ids_start + 4 * self.max_top_k
        rows[:, ids_start:weights_start] = ids_full.view(torch.uint8)
        rows[:, weights_start : weights_start + 4 * self.max_top_k] = weights_full.view(torch.uint8)
        return rows

    def unpack(
        self, rows: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[R, H]`` hidden, ``[R, top_k]`` int32 ids, ``[R, top_k]`` fp32 weights (copies)."""
        hidden_end = self.hidden_size * self.dtype.itemsize
        ids_start = self.hidden_bytes
        weights_start = ids_start + 4 * self.max_top_k
        hidden = rows[:, :hidden_end].contiguous().view(self.dtype)
        ids = rows[:, ids_start:weights_start].contiguous().view(torch.int32)[:, :top_k]
        weights = rows[:, weights_start : weights_start + 4 * self.max_top_k]
        weights = weights.contiguous().view(torch.float32)[:, :top_k]
        return hidden, ids, weights


@dataclass
class _Route:
    """Where this rank's tokens go: ``mask [T, W]`` and each (token, rank) pair's slot."""

    mask: torch.Tensor  # [T, W] bool: token t goes to rank r
    slot: torch.Tensor  # [T, W] int64: position of t among the tokens sent to r
    send_counts: torch.Tensor  # [W] int64
    top_k: int


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
    num_tokens: int


@DISPATCHERS.register
class TorchAllToAll(Dispatcher):
    """The portable dispatcher: runs anywhere torch.distributed does, any world size."""

    name = "torch_a2a"
    capabilities = DispatcherCapabilities(
        layouts=frozenset(TopkLayout),
        modes=frozenset(DispatchMode),
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float32}),
    )
    auto_priority = 0

    def __init__(self, setup: DispatchSetup) -> None:
        super().__init__(setup)
        self.codec = RowCodec(setup.hidden_size, setup.dtype, setup.max_top_k)
        self.num_local = self.placement.num_local_experts
        self.local_offset = self.placement.local_expert_offset

    # ----------------------------------------------------------------- routing (sender side)
    def _route(self, topk_ids: torch.Tensor) -> _Route:
        ids = topk_ids.to(torch.int64)
        num_tokens, top_k = ids.shape
        world = self.comm.world_size
        # owner rank per slot; -1 // L = -1 and -1 mod (W + 1) = W: unused slots go to column W
        dest = torch.remainder(torch.floor_divide(ids, self.num_local), world + 1)
        mask = torch.zeros(num_tokens, world + 1, dtype=torch.bool, device=ids.device)
        mask = mask.scatter_(1, dest, True)[:, :world]
        slot = mask.cumsum(0)  # int64
        return _Route(mask, slot - 1, slot[-1] if num_tokens else slot.sum(0), top_k)

    def _combine_positions(self, route: _Route, rank_base: torch.Tensor) -> torch.Tensor:
        """``[T, J]``: rows of the combine receive buffer holding token t's per-rank results
        (``rank_base[r]`` = first row from rank r), J = min(K, W); unused = buffer length."""
        num_tokens, world = route.mask.shape
        width = max(1, min(route.top_k, world))
        rank_slot = route.mask.to(torch.int64).cumsum(1) - 1  # j-th destination of token t
        position = rank_base.unsqueeze(0) + route.slot
        trash = torch.full_like(position, width)
        table = torch.full((num_tokens, width + 1), -1, dtype=torch.int64, device=position.device)
        table.scatter_(1, torch.where(route.mask, rank_slot, trash), position)
        return table[:, :width]

    # ----------------------------------------------------------------- receive side
    def _received(
        self,
        hidden: torch.Tensor,  # [R, H]
        ids: torch.Tensor,  # [R, K] int32 global
        weights: torch.Tensor,  # [R, K] fp32
        row_valid: torch.Tensor | None,  # [R] bool, None = all valid
        layout: TopkLayout,
        expanded_rows: int,
        expert_num_tokens_cpu: list[int] | None,
    ) -> tuple[Dispatched, torch.Tensor | None]:
        """Keep the slots this rank serves; expand for EXPANDED. Returns (dispatched, positions)."""
        local = ids.to(torch.int64) - self.local_offset
        served = (local >= 0) & (local < self.num_local)
        if row_valid is not None:
            served &= row_valid.unsqueeze(1)
        poison = self.setup.poison
        filler = float("nan") if poison else 0.0
        global_ids = torch.where(served, ids, torch.full_like(ids, -1))
        weights = torch.where(served, weights, torch.full_like(weights, filler))
        if poison and row_valid is not None:
            hidden = torch.where(row_valid.unsqueeze(1), hidden, torch.full_like(hidden, filler))
        local_index = torch.where(served, local, torch.full_like(local, self.num_local))
        if layout is TopkLayout.STANDARD:
            counts = count_per_expert(local_index, self.num_local)
            num_valid = hidden.size(0) if row_valid is None else self._valid_row_bound(row_valid)
            dispatched = Dispatched(
                hidden_states=hidden,
                topk_ids=global_ids,
                topk_weights=weights,
                layout=layout,
                expert_offsets=None,
                expert_num_tokens=counts.to(torch.int32),
                expert_num_tokens_cpu=expert_num_tokens_cpu,
                num_valid_rows=num_valid,
                handle=None,
            )
            return dispatched, None
        plan = plan_expansion(local_index, self.num_local, expanded_rows)
        valid = plan.valid.unsqueeze(1)
        expert_of_row = torch.searchsorted(
            plan.expert_offsets[1:].to(torch.int64),
            torch.arange(expanded_rows, device=ids.device),
            right=True,
        )
        expanded_ids = torch.where(
            plan.valid, expert_of_row + self.local_offset, torch.full_like(expert_of_row, -1)
        )
        expanded_hidden = hidden.index_select(0, plan.source_row)
        expanded_weights = weights[plan.source_row, plan.source_slot]
        expanded_weights = torch.where(
            plan.valid, expanded_weights, torch.full_like(expanded_weights, filler)
        )
        if poison:
            expanded_hidden = torch.where(
                valid, expanded_hidden, torch.full_like(expanded_hidden, filler)
            )
        dispatched = Dispatched(
            hidden_states=expanded_hidden,
            topk_ids=expanded_ids.to(torch.int32).unsqueeze(1),
            topk_weights=expanded_weights.unsqueeze(1),
            layout=layout,
            expert_offsets=plan.expert_offsets,
            expert_num_tokens=plan.expert_num_tokens,
            expert_num_tokens_cpu=expert_num_tokens_cpu,
            num_valid_rows=expanded_rows
            if expert_num_tokens_cpu is not None
            else plan.expert_offsets[-1],
            handle=None,
        )
        return dispatched, plan.slot_position

    @staticmethod
    def _valid_row_bound(row_valid: torch.Tensor) -> torch.Tensor:
        """0-d tensor: one past the last valid row (an upper bound on rows holding data)."""
        index = torch.arange(1, row_valid.numel() + 1, device=row_valid.device)
        return torch.amax(row_valid * index)

    def _pre_reduce(
        self, expert_output: torch.Tensor, dispatched: Dispatched, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows to send back: EXPANDED rows summed per received row in fp32, rounded once."""
        if positions is None:
            return expert_output
        return sum_rows_fp32(expert_output, positions).to(self.setup.dtype)

    # ----------------------------------------------------------------- exact mode
    def _exact_header(
        self,
        status: ForwardStatus,
        num_local_chunks: int,
        top_k: int,
        route: _Route | None,
        topk_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """``[W, 4 + L]`` int64: status, chunks, K, rows to that rank, rows per expert there."""
        world, device = self.comm.world_size, self.comm.device
        header = torch.zeros(
            world, HEADER_FIELDS + self.num_local, dtype=torch.int64, device=device
        )
        header[:, 0] = int(status)
        header[:, 1] = num_local_chunks
        header[:, 2] = top_k
        if route is not None and topk_ids is not None:
            num_experts = self.placement.num_experts
            ids = topk_ids.to(torch.int64)
            flat = torch.where(ids >= 0, ids, torch.full_like(ids, num_experts)).reshape(-1)
            per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
            per_expert.scatter_add_(0, flat, torch.ones_like(flat))
            header[:, 3] = route.send_counts
            header[:, HEADER_FIELDS:] = per_expert[:num_experts].view(world, self.num_local)
        return header

    def _exchange_exact_header(self, header: torch.Tensor) -> tuple[list[int], list[list[int]]]:
        """The header all-to-all and the forward's one host sync.

        Returns (rows this rank sends to each rank, each source rank's header)."""
        received = torch.empty_like(header)
        self.comm.all_to_all_single(received, header)
        world, width = header.shape
        host = torch.cat([header[:, 3], received.reshape(-1)]).tolist()
        return host[:world], [
            host[world + r * width : world + (r + 1) * width] for r in range(world)
        ]

    def _dispatch_exact(self, x, topk_ids, topk_weights, layout, num_local_chunks) -> Dispatched:
        route = self._route(topk_ids)
        header = self._exact_header(
            ForwardStatus.OK, num_local_chunks, route.top_k, route, topk_ids
        )
        send_counts, headers = self._exchange_exact_header(header)
        num_chunks = self.peer_status.raise_on_host(headers, route.top_k)
        recv_counts = [h[3] for h in headers]
        expert_counts = [sum(h[HEADER_FIELDS + e] for h in headers) for e in range(self.num_local)]
        total_send = sum(send_counts)
        pairs = torch.nonzero_static(
            route.mask.t(), size=total_send
        )  # [S, 2] (rank, token) by rank
        packed = self.codec.pack(x, topk_ids.to(torch.int32), topk_weights)
        send_rows = packed.index_select(0, pairs[:, 1])
        recv_rows = torch.empty(
            sum(recv_counts), self.codec.row_bytes, dtype=torch.uint8, device=x.device
        )
        self.comm.all_to_all_single(recv_rows, send_rows, recv_counts, send_counts)
        hidden, ids, weights = self.codec.unpack(recv_rows, route.top_k)
        dispatched, positions = self._received(
            hidden, ids, weights, None, layout, sum(expert_counts), expert_counts
        )
        rank_base = torch.tensor([0, *send_counts[:-1]], device=x.device).cumsum(0)
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

    @staticmethod
    def _positions_or_trash(table: torch.Tensor, buffer_rows: int) -> torch.Tensor:
        return torch.where(table >= 0, table, torch.full_like(table, buffer_rows))

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

    def _finish(
        self, received: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        total = sum_rows_fp32(received, positions)
        if out is None:
            return total.to(self.setup.dtype)
        out.copy_(total)
        return out

    # ----------------------------------------------------------------- capacity mode
    def _capacity_send(
        self, route: _Route | None, packed: torch.Tensor | None, status: ForwardStatus, top_k: int
    ) -> torch.Tensor:
        """``[W, 1 + cap, row_bytes]``: a header row then the rows for each destination."""
        world, cap, device = self.comm.world_size, self.setup.max_tokens_per_rank, self.comm.device
        row_bytes = self.codec.row_bytes
        send = torch.zeros(world, 1 + cap, row_bytes, dtype=torch.uint8, device=device)
        header = torch.zeros(world, HEADER_FIELDS, dtype=torch.int32, device=device)
        header[:, 0] = int(status)
        header[:, 1] = 1
        header[:, 2] = top_k
        if route is not None and packed is not None:
            header[:, 3] = route.send_counts.to(torch.int32)
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
        recv_counts = header[:, 3].to(torch.int64)
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
            num_tokens=x.size(0),
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
        status = ForwardStatus.of(error)
        if self.setup.mode is DispatchMode.EXACT:
            header = self._exact_header(status, 1, self.setup.max_top_k, None, None)
            _, headers = self._exchange_exact_header(header)
            self.peer_status.raise_on_host(headers, self.setup.max_top_k, error)
        send = self._capacity_send(None, None, status, self.setup.max_top_k)
        _, header = self._capacity_exchange(send)
        if self.host_reads_free:
            self.peer_status.raise_on_host(header.tolist(), self.setup.max_top_k, error)
        world, cap = self.comm.world_size, self.setup.max_tokens_per_rank
        zeros = torch.zeros(
            world * cap, self.setup.hidden_size, dtype=self.setup.dtype, device=self.comm.device
        )
        self.comm.all_to_all_single(torch.empty_like(zeros), zeros)
        raise error
