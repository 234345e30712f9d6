"""A forward's dispatched rows in one padded block per local expert, as the block-scaled fp8
GEMMs take them (``scaled_mm``: cuBLAS per expert; ``deepgemm``: one m-grouped GEMM). The row
kernels and their torch specs are ``experts/gemm/block_rows.py``; this is the order the backends
share: ``q(x)``, STANDARD's pairs sorted by expert, the block starts, the rows and their scales
copied into the blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ep_runtime.experts.base import WorkBuffers, quantized_rows
from ep_runtime.experts.gemm.block_rows import (
    BlockLayout,
    activate_rows,
    group_rows,
    max_block_rows,
    pad_offsets,
)
from ep_runtime.experts.gemm.expert_rows import sort_pairs
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import BLOCK, FP8_DTYPE
from ep_runtime.types import Dispatched, TopkLayout


@dataclass(frozen=True)
class GroupedRows:
    """One forward's rows in expert blocks (``P'`` block rows, at most ``bound``)."""

    rows: torch.Tensor  # [bound, H] e4m3, GEMM1's input (rows past P' stale)
    row_scales: torch.Tensor  # [G·S] fp32, the layout's scales of ``rows``
    pair_of: torch.Tensor  # [bound] int32: each block row's pair (-1 = padding)
    padded: torch.Tensor  # [L + 1] int32 block starts (on the device)
    ends: torch.Tensor | None  # [L] int32 block start + row count (layouts that need it)
    positions: torch.Tensor  # [R, K'] int32: each pair's block row (-1: not served here)
    weights: torch.Tensor  # [R, K'] fp32 router weights
    top_k: int  # K' (1 for EXPANDED)
    sorted_pairs: bool  # pair_of holds row·K + slot (STANDARD), else the row (EXPANDED)
    bound: int  # max_block_rows: the buffers' rows and the row kernels' grid


class BlockGrouping:
    """Groups each forward's rows into blocks of ``layout``; holds the per-forward maps."""

    def __init__(
        self,
        layout: BlockLayout,
        placement: ExpertPlacement,
        buffers: WorkBuffers,
        *,
        with_ends: bool,
    ) -> None:
        self.layout = layout
        self.local_offset = placement.local_expert_offset
        self.num_local = placement.num_local_experts
        self.buffers = buffers
        device = buffers.device
        self._offsets = torch.zeros(self.num_local + 1, dtype=torch.int32, device=device)
        self._padded = torch.zeros_like(self._offsets)
        self._ends = self._offsets.new_zeros(self.num_local) if with_ends else None

    def max_block_rows(self, num_grouped: int) -> int:
        return max_block_rows(num_grouped, self.num_local, self.layout)

    def group(
        self,
        dispatched: Dispatched,
        on_block_starts: Callable[[torch.Tensor], None] | None = None,
    ) -> GroupedRows:
        """The rows in blocks; ``on_block_starts(padded)`` runs once the starts are queued,
        before the rows are (a backend that reads them on the host starts its copy there)."""
        num_rows, hidden = dispatched.hidden_states.shape  # [R, H]
        get = self.buffers.get
        x_q, x_s = quantized_rows(dispatched, self.buffers)
        if dispatched.layout is TopkLayout.EXPANDED:
            assert dispatched.expert_offsets is not None
            offsets, pairs, top_k = dispatched.expert_offsets, None, 1
        else:
            top_k = dispatched.topk_ids.size(1)
            pairs = get("pairs", num_rows * top_k, 1, torch.int32).view(-1)  # [R·K]
            offsets = self._offsets
            sort_pairs(
                dispatched.topk_ids,
                pairs,
                offsets,
                local_offset=self.local_offset,
                num_local=self.num_local,
            )
        padded = pad_offsets(offsets, self._padded, self.layout, self._ends)
        if on_block_starts is not None:
            on_block_starts(padded)
        bound = self.max_block_rows(num_rows * top_k)
        scale_floats = hidden // BLOCK * self.layout.scale_stride(bound)
        rows = get("rows", bound, hidden, FP8_DTYPE)  # [bound, H]
        row_scales = get("row_scales", scale_floats, 1, torch.float32).view(-1)
        pair_of = get("pair_of", bound, 1, torch.int32).view(-1)
        positions = get("positions", num_rows * top_k, 1, torch.int32).view(-1)
        group_rows(
            x_q, x_s, pairs, offsets, padded, rows, row_scales, pair_of, positions, self.layout,
            top_k=top_k,
        )  # fmt: skip
        return GroupedRows(
            rows=rows,
            row_scales=row_scales,
            pair_of=pair_of,
            padded=padded,
            ends=self._ends,
            positions=positions.view(num_rows, top_k),
            weights=dispatched.topk_weights,
            top_k=top_k,
            sorted_pairs=pairs is not None,
            bound=bound,
        )

    def activate(
        self,
        grouped: GroupedRows,
        up_out: torch.Tensor,  # [≥ P', 2I | I] GEMM1's output
        act: torch.Tensor,  # [≥ P', I] e4m3 out
        act_scales: torch.Tensor,  # [G·S] fp32 out
        *,
        gated: bool,
    ) -> None:
        """``q(act(GEMM1))`` with the router weight folded into its scales."""
        activate_rows(
            up_out, grouped.pair_of, grouped.weights, grouped.padded, act, act_scales,
            self.layout, top_k=grouped.top_k, gated=gated, sorted_pairs=grouped.sorted_pairs,
        )  # fmt: skip

    def workspace_bytes(self, max_rows: int, top_k: int, hidden: int, per_block_row: int) -> int:
        """The blocks' bytes: GEMM1's input and its scales, the maps, and ``per_block_row`` more
        bytes a block row (the backend's own buffers); plus the rows quantized here."""
        blocks = self.max_block_rows(max_rows * top_k)
        own = hidden + 4 * hidden // BLOCK + 8  # e4m3 row, its scales, pair_of, sort index
        per_row = hidden + 4 * hidden // BLOCK + 4 * top_k  # q(x) and positions
        return blocks * (own + per_block_row) + max_rows * per_row
