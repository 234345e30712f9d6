"""The token-row machinery shared by the dispatchers that move packed rows: packing, routing
(which ranks a token goes to and where its rows land), the receive side (keep the served slots,
expand for EXPANDED) and the fp32 reductions of combine. Transports subclass ``RowDispatcher``.

Wire format: a token travels once to each rank owning at least one of its experts, as one packed
byte row ``hidden | ids int32 [K_max] | weights fp32 [K_max]``. The receiver keeps the slots it
serves (global ids, -1 elsewhere) and, for EXPANDED, expands one row per (token, local expert),
grouped by expert, ordered by (source rank, token) within a group. Before sending back, it
pre-reduces a token's local rows in fp32; the source sums the per-rank rows in fp32 in a fixed
order (no atomics: two runs are bitwise equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_runtime.dispatch.base import Dispatcher, DispatchSetup
from ep_runtime.expand import count_per_expert, plan_expansion, sum_rows_fp32
from ep_runtime.experts.base import local_expert_index
from ep_runtime.types import Dispatched, TopkLayout

NUM_ROWS = 3  # header column after base.py's STATUS, NUM_CHUNKS, TOP_K: rows sent to that rank
HEADER_FIELDS = 4  # exact mode appends the per-local-expert counts


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
class Route:
    """Where this rank's tokens go: ``mask [T, W]`` and each (token, rank) pair's slot."""

    mask: torch.Tensor  # [T, W] bool: token t goes to rank r
    slot: torch.Tensor  # [T, W] int64: position of t among the tokens sent to r
    send_counts: torch.Tensor  # [W] int64
    top_k: int


class RowDispatcher(Dispatcher):
    """Base of the packed-row transports (``torch_a2a``, ``torch_symm_mem``); not registered."""

    def __init__(self, setup: DispatchSetup) -> None:
        super().__init__(setup)
        self.codec = RowCodec(setup.hidden_size, setup.dtype, setup.max_top_k)
        self.num_local = self.placement.num_local_experts
        self.local_offset = self.placement.local_expert_offset

    # ----------------------------------------------------------------- routing (sender side)
    def _route(self, topk_ids: torch.Tensor) -> Route:
        ids = topk_ids.to(torch.int64)
        num_tokens, top_k = ids.shape
        world = self.comm.world_size
        # owner rank per slot; -1 // L = -1 and -1 mod (W + 1) = W: unused slots go to column W
        dest = torch.remainder(torch.floor_divide(ids, self.num_local), world + 1)
        mask = torch.zeros(num_tokens, world + 1, dtype=torch.bool, device=ids.device)
        mask = mask.scatter_(1, dest, True)[:, :world]
        slot = mask.cumsum(0)  # int64
        return Route(mask, slot - 1, slot[-1] if num_tokens else slot.sum(0), top_k)

    def _combine_positions(self, route: Route, rank_base: torch.Tensor) -> torch.Tensor:
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
        local = local_expert_index(ids, self.placement)  # [R, K], L = not served here
        served = local < self.num_local
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

    @staticmethod
    def _positions_or_trash(table: torch.Tensor, buffer_rows: int) -> torch.Tensor:
        return torch.where(table >= 0, table, torch.full_like(table, buffer_rows))

    def _finish(
        self, received: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        total = sum_rows_fp32(received, positions)
        if out is None:
            return total.to(self.setup.dtype)
        out.copy_(total)
        return out
