"""``group_rows``: received rows regrouped by local expert (a counting sort, stable).

The torch function is the spec (and the CPU path); the Triton one is bitwise equal to it and
reads no device value on the host.
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.triton_common import (
    TILE_ELEMENTS,
    cdiv,
    jit,
    kernel,
    pow2,
    row_block,
    stride_units,
    tl,
)
from ep_runtime.kernels.types import Grouped
from ep_runtime.placement import LocalExperts


def torch_group_rows(
    hidden: torch.Tensor,  # [R, H] (a strided view is fine)
    topk_ids: torch.Tensor,  # [R, K] int32 global ids, anything not served here is ignored
    topk_weights: torch.Tensor,  # [R, K] float
    *,
    local_offset: int,
    num_local: int,
    num_rows: int,
    poison: bool = False,
) -> Grouped:
    """Counting sort of the served (row, slot) pairs by local expert, stable in (row, slot).

    ``num_rows`` is the grouped row count: exact, or a static bound; a pair that would land at or
    past it (only possible for malformed input, e.g. repeated ids) is dropped."""
    num_src, top_k = topk_ids.shape
    num_pairs = num_src * top_k
    device = hidden.device
    filler = float("nan") if poison else 0.0
    key = LocalExperts(local_offset, num_local).index(topk_ids).reshape(-1)  # [R·K], L = not here
    served = key < num_local
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    ends = counts[:num_local].cumsum(0).clamp(max=num_rows)  # [L]
    offsets = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)  # [L + 1]
    order = torch.sort(key, stable=True).indices  # served pairs first, by (expert, row, slot)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_pairs, device=device)
    positions = torch.where(served & (rank < num_rows), rank, -1).view(num_src, top_k)
    grouped_hidden = torch.full(
        (num_rows, hidden.size(1)), filler, dtype=hidden.dtype, device=device
    )
    grouped_weights = torch.full((num_rows,), filler, dtype=torch.float32, device=device)
    grouped_ids = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    if num_pairs and num_rows:
        source_pair = torch.cat([order, order.new_zeros(max(0, num_rows - num_pairs))])[:num_rows]
        valid = torch.arange(num_rows, device=device) < ends[-1]  # [N]
        source_row = source_pair // top_k
        grouped_hidden = torch.where(
            valid.unsqueeze(1), hidden.index_select(0, source_row), grouped_hidden
        )
        weights = topk_weights.reshape(-1).float().index_select(0, source_pair)
        grouped_weights = torch.where(valid, weights, grouped_weights)
        expert = key.index_select(0, source_pair) + local_offset
        grouped_ids = torch.where(valid, expert.to(torch.int32), grouped_ids)
    positions = positions.to(torch.int32)
    return Grouped(grouped_hidden, grouped_weights, grouped_ids, positions, offsets)


# --------------------------------------------------------------------------- Triton
@jit
def _served_experts(
    topk_ids, ids_stride_r, ids_stride_k, pairs, num_pairs, top_k, local_offset, num_local
):
    """``[P]`` local expert of each (row, slot) pair ``pairs`` (numbered row·K + slot), and
    whether this rank serves it."""
    in_range = pairs < num_pairs
    src = pairs // top_k
    slot = pairs - src * top_k
    ids = tl.load(
        topk_ids + src.to(tl.int64) * ids_stride_r + slot * ids_stride_k, mask=in_range, other=-1
    )
    local = ids.to(tl.int64) - local_offset
    served = in_range & (local >= 0) & (local < num_local)
    return tl.where(served, local, 0).to(tl.int32), served


@kernel
def _group_count_kernel(
    topk_ids,  # [R, K] int32
    ids_stride_r,
    ids_stride_k,
    block_counts,  # [NB, LP] int32: served pairs per (block of pairs, local expert)
    num_pairs,
    top_k,
    local_offset,
    num_local,
    LP: tl.constexpr,  # num_local padded to a power of two
    BP: tl.constexpr,  # pairs per block
    SUB: tl.constexpr,  # pairs per step (SUB·LP bounds the one-hot tile)
):
    block = tl.program_id(0)
    e = tl.arange(0, LP)
    counts = tl.zeros([LP], dtype=tl.int32)
    for step in range(0, BP, SUB):
        pairs = block * BP + step + tl.arange(0, SUB)
        expert, served = _served_experts(
            topk_ids, ids_stride_r, ids_stride_k, pairs, num_pairs, top_k, local_offset, num_local
        )
        one_hot = served[:, None] & (expert[:, None] == e[None, :])  # [SUB, LP]
        counts += tl.sum(one_hot.to(tl.int32), axis=0)
    tl.store(block_counts + block * LP + e, counts)


@kernel
def _group_place_kernel(
    topk_ids,  # [R, K] int32
    ids_stride_r,
    ids_stride_k,
    block_counts,  # [NB, LP] int32
    positions,  # [R, K] int32, contiguous: grouped row of each pair, -1 = none
    source_pair,  # [N] int32: the pair at each grouped row (rows < offsets[L])
    offsets,  # [L + 1] int32
    num_pairs,
    num_blocks,
    top_k,
    local_offset,
    num_local,
    num_rows,  # N
    LP: tl.constexpr,
    BP: tl.constexpr,
    SUB: tl.constexpr,
    BB: tl.constexpr,  # blocks per step over block_counts
):
    """Program per block of pairs: expert starts (all blocks' counts) plus the pairs of earlier
    blocks give each expert's first row here; a running one-hot cumsum ranks the pairs within
    the block, in (row, slot) order."""
    block = tl.program_id(0)
    e = tl.arange(0, LP)
    totals = tl.zeros([LP], dtype=tl.int32)
    before = tl.zeros([LP], dtype=tl.int32)
    for first in range(0, num_blocks, BB):
        b = first + tl.arange(0, BB)
        counts = tl.load(
            block_counts + b[:, None] * LP + e[None, :], mask=b[:, None] < num_blocks, other=0
        )
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where(b[:, None] < block, counts, 0), axis=0)
    ends = tl.cumsum(totals, 0)
    if block == 0:
        tl.store(offsets + e + 1, tl.minimum(ends, num_rows), mask=e < num_local)
        tl.store(offsets, 0)
    base = ends - totals + before  # [LP] next grouped row of each expert in this block
    for step in range(0, BP, SUB):
        pairs = block * BP + step + tl.arange(0, SUB)
        expert, served = _served_experts(
            topk_ids, ids_stride_r, ids_stride_k, pairs, num_pairs, top_k, local_offset, num_local
        )
        one_hot = (served[:, None] & (expert[:, None] == e[None, :])).to(tl.int32)  # [SUB, LP]
        rank = tl.cumsum(one_hot, axis=0) - 1 + base[None, :]
        position = tl.sum(tl.where(one_hot != 0, rank, 0), axis=1)  # [SUB]
        base += tl.sum(one_hot, axis=0)
        placed = served & (position < num_rows)
        tl.store(positions + pairs, tl.where(placed, position, -1), mask=pairs < num_pairs)
        tl.store(source_pair + position, pairs, mask=placed)


@kernel
def _group_gather_kernel(
    hidden,  # [R, H]
    hidden_rows,  # row stride in units of UNIT elements
    hidden_stride_h,
    topk_ids,  # [R, K] int32
    ids_stride_r,
    ids_stride_k,
    topk_weights,  # [R, K] float
    weights_stride_r,
    weights_stride_k,
    source_pair,  # [N] int32
    offsets,  # [L + 1] int32
    out_hidden,  # [N, H], contiguous
    out_weights,  # [N] fp32
    out_ids,  # [N] int32
    hidden_size,
    out_rows,  # H in units of OUT_UNIT elements
    top_k,
    num_local,
    POISON: tl.constexpr,
    UNIT: tl.constexpr,
    OUT_UNIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (grouped row, block of H): copies its source row's block; padding rows (past
    offsets[L]) get filler weight and id -1, and NaN hidden in poison mode (else untouched)."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    valid = row < tl.load(offsets + num_local)
    pair = tl.load(source_pair + row, mask=valid, other=0)
    src = pair // top_k
    slot = pair - src * top_k
    src64 = src.to(tl.int64)
    h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden_size
    values = tl.load(
        hidden + src64 * hidden_rows * UNIT + h * hidden_stride_h, mask=in_row & valid, other=0.0
    )
    dest = out_hidden + row.to(tl.int64) * out_rows * OUT_UNIT + h
    if POISON:
        tl.store(dest, tl.where(valid, values.to(tl.float32), float("nan")), mask=in_row)
    else:
        tl.store(dest, values, mask=in_row & valid)
    if block == 0:
        weight = tl.load(
            topk_weights + src64 * weights_stride_r + slot * weights_stride_k, mask=valid, other=0
        )
        expert = tl.load(topk_ids + src64 * ids_stride_r + slot * ids_stride_k, mask=valid)
        weight = weight.to(tl.float32)
        if POISON:
            weight = tl.where(valid, weight, float("nan"))
        tl.store(out_weights + row, weight)
        tl.store(out_ids + row, tl.where(valid, expert, -1))


def triton_group_rows(
    hidden: torch.Tensor,  # [R, H] (a strided view is fine)
    topk_ids: torch.Tensor,  # [R, K] int32 global ids, anything not served here is ignored
    topk_weights: torch.Tensor,  # [R, K] float
    *,
    local_offset: int,
    num_local: int,
    num_rows: int,
    poison: bool = False,
) -> Grouped:
    """Counting sort of the served (row, slot) pairs by local expert, stable in (row, slot):
    three launches (per-block counts, placement, row gather); ``torch_group_rows`` is the
    spec. Padding hidden rows are left unwritten unless ``poison`` (then NaN)."""
    num_src, top_k = topk_ids.shape
    hidden_size = hidden.size(1)
    num_pairs = num_src * top_k
    device = hidden.device
    lp = pow2(num_local)
    sub = max(1, min(TILE_ELEMENTS // lp, pow2(num_pairs)))
    pairs_per_block = max(sub, min(1024, pow2(-(-num_pairs // 128))))
    num_blocks = cdiv(num_pairs, pairs_per_block)
    block_counts = torch.empty(max(num_blocks, 1), lp, dtype=torch.int32, device=device)
    positions = torch.empty(num_src, top_k, dtype=torch.int32, device=device)
    source_pair = torch.empty(max(num_rows, 1), dtype=torch.int32, device=device)
    offsets = torch.empty(num_local + 1, dtype=torch.int32, device=device)
    out_hidden = torch.empty(num_rows, hidden_size, dtype=hidden.dtype, device=device)
    out_weights = torch.empty(num_rows, dtype=torch.float32, device=device)
    out_ids = torch.empty(num_rows, dtype=torch.int32, device=device)
    ids_args = (topk_ids, topk_ids.stride(0), topk_ids.stride(1))
    sizes = dict(LP=lp, BP=pairs_per_block, SUB=sub)
    if num_blocks:
        _group_count_kernel[(num_blocks,)](
            *ids_args, block_counts, num_pairs, top_k, local_offset, num_local, **sizes
        )
    placed = (block_counts, positions, source_pair, offsets, num_pairs, num_blocks)
    _group_place_kernel[(max(num_blocks, 1),)](
        *ids_args,
        *placed,
        top_k,
        local_offset,
        num_local,
        num_rows,
        BB=max(1, min(64, TILE_ELEMENTS // lp)),
        **sizes,
    )
    if num_rows:
        block, warps = row_block(hidden_size, hidden.element_size())
        hidden_rows, unit = stride_units(hidden.stride(0), hidden.element_size())
        out_rows, out_unit = stride_units(hidden_size, hidden.element_size())
        _group_gather_kernel[(num_rows, cdiv(hidden_size, block))](
            *(hidden, hidden_rows, hidden.stride(1)),
            *ids_args,
            *(topk_weights, topk_weights.stride(0), topk_weights.stride(1)),
            *(source_pair, offsets, out_hidden, out_weights, out_ids),
            hidden_size,
            out_rows,
            top_k,
            num_local,
            POISON=poison,
            UNIT=unit,
            OUT_UNIT=out_unit,
            BLOCK_H=block,
            num_warps=warps,
        )
    return Grouped(out_hidden, out_weights, out_ids, positions, offsets)
