"""``sum_rows``: each output row the fp32 sum of chosen source rows, in a fixed order.

The torch function is the spec (and the CPU path); the Triton one is bitwise equal to it and
reads no device value on the host.
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.layout import ChunkLayout, chunk_starts
from ep_runtime.kernels.triton_common import (
    capacity_arg,
    cdiv,
    kernel,
    pow2,
    rounded,
    row_block,
    stride_units,
    tl,
)


def torch_sum_rows(
    source: torch.Tensor,  # [S, H]
    positions: torch.Tensor,  # [T, J] int32 rows of source to add, -1 = nothing
    out: torch.Tensor | None = None,  # [T, H]; a strided view is fine
    *,
    chunk_counts: torch.Tensor | None = None,  # [J] token rows per chunk of ``source``
    chunks: ChunkLayout | None = None,  # given: position (t, j) is a row of source's chunk j
    failed: torch.Tensor | None = None,  # 0-d int: nonzero → every output row is NaN
    own_rows: bool = False,  # a position ≥ 0 stands for source row t itself
) -> torch.Tensor:
    """``out[t] = Σ_j source[row(t, j)]`` in fp32, adding j = 0, 1, … in order, rounded once;
    ``row(t, j)`` is ``positions[t, j]``, or with ``chunks`` that token row of chunk j, or with
    ``own_rows`` row t (where ``positions[t, j] ≥ 0``: a world of one, whose results sit at their
    token's row, reduces only the tokens the route sent).

    Deterministic (no atomics); a row no position refers to (padding, NaN) never enters a sum; a
    row with no positions is exactly zero."""
    num_out = positions.size(0)
    rows = positions.to(torch.int64)
    if own_rows:
        token = torch.arange(num_out, device=positions.device).unsqueeze(1)
        rows = torch.where(rows >= 0, token, -1)
    if chunks is not None:
        assert chunk_counts is not None
        base = chunk_starts(chunk_counts, chunks) + chunks.header_rows  # [J]
        rows = torch.where(rows >= 0, rows + base, -1)
    total = torch.zeros(num_out, source.size(1), dtype=torch.float32, device=source.device)
    if source.size(0):
        for column in rows.t():
            used = (column >= 0).unsqueeze(1)
            picked = source.index_select(0, column.clamp(min=0))
            total += torch.where(used, picked.float(), 0.0)
    if failed is not None:
        total = torch.where(failed != 0, float("nan"), total)
    if out is None:
        return total.to(source.dtype)
    out.copy_(total)
    return out


# --------------------------------------------------------------------------- Triton
@kernel
def _sum_kernel(
    source,  # [S, H]
    source_rows,  # row stride in units of SOURCE_UNIT elements
    source_stride_h,
    positions,  # [T, J] int32
    positions_stride_t,
    positions_stride_j,
    chunk_counts,  # [J] token rows per chunk (with CHUNKED)
    counts_stride,
    failed,  # 0-d int (with HAS_FAILED)
    out,  # [T, H]
    out_rows,  # row stride in units of OUT_UNIT elements
    out_stride_h,
    num_sources,
    hidden_size,
    num_terms,  # J
    header_rows,
    capacity,  # -1: exact chunk sizes
    CHUNKED: tl.constexpr,
    OWN_ROWS: tl.constexpr,
    HAS_FAILED: tl.constexpr,
    SOURCE_UNIT: tl.constexpr,
    OUT_UNIT: tl.constexpr,
    JB: tl.constexpr,  # terms per step, unrolled: their loads are in flight together
    BLOCK_H: tl.constexpr,
):
    """Program (output row, block of H): adds j = 0, 1, … in order in fp32, rounds once."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden_size
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    base = t * 0 + header_rows  # int64: first token row of chunk j
    for first in range(0, num_terms, JB):
        for step in tl.static_range(JB):
            j = first + step
            term = j < num_terms
            at = positions + t * positions_stride_t + j * positions_stride_j
            position = tl.load(at, mask=term, other=-1)
            used = (position >= 0) & (num_sources > 0)
            row = position.to(tl.int64)
            if OWN_ROWS:
                row = t
            if CHUNKED:
                row += base
                if capacity >= 0:
                    base += header_rows + capacity
                else:
                    count = tl.load(chunk_counts + j * counts_stride, mask=term, other=0)
                    base += count.to(tl.int64) + header_rows
            values = tl.load(
                source + row * source_rows * SOURCE_UNIT + h * source_stride_h,
                mask=in_row & used,
                other=0.0,
            )
            total += values.to(tl.float32)  # + 0.0 where unused: exact (total is never -0.0)
    if HAS_FAILED:
        total = tl.where(tl.load(failed) != 0, float("nan"), total)
    dest = out + t * out_rows * OUT_UNIT + h * out_stride_h
    tl.store(dest, rounded(total, out.dtype.element_ty), mask=in_row)


def triton_sum_rows(
    source: torch.Tensor,  # [S, H]
    positions: torch.Tensor,  # [T, J] int32 rows of source to add, -1 = nothing
    out: torch.Tensor | None = None,  # [T, H]; a strided view is fine
    *,
    chunk_counts: torch.Tensor | None = None,  # [J] token rows per chunk of ``source``
    chunks: ChunkLayout | None = None,  # given: position (t, j) is a row of source's chunk j
    failed: torch.Tensor | None = None,  # 0-d int: nonzero → every output row is NaN
    own_rows: bool = False,  # a position ≥ 0 stands for source row t itself
) -> torch.Tensor:
    """``out[t] = Σ_j source[row(t, j)]`` in fp32, adding j = 0, 1, … in order, rounded once
    (one launch; ``torch_sum_rows`` is the spec). No atomics: deterministic."""
    num_out, num_terms = positions.shape
    hidden_size = source.size(1)
    if out is None:
        out = torch.empty(num_out, hidden_size, dtype=source.dtype, device=source.device)
    if chunks is not None:
        assert chunk_counts is not None
    if num_out == 0 or hidden_size == 0:
        return out
    block, warps = row_block(hidden_size, source.element_size())
    source_rows, source_unit = stride_units(source.stride(0), source.element_size())
    out_rows, out_unit = stride_units(out.stride(0), out.element_size())
    counts = chunk_counts if chunk_counts is not None else positions  # unread without chunks
    flag = failed if failed is not None else positions  # unread without ``failed``
    _sum_kernel[(num_out, cdiv(hidden_size, block))](
        source,
        source_rows,
        source.stride(1),
        positions,
        positions.stride(0),
        positions.stride(1),
        counts,
        counts.stride(0),
        flag,
        out,
        out_rows,
        out.stride(1),
        source.size(0),
        hidden_size,
        num_terms,
        chunks.header_rows if chunks is not None else 0,
        capacity_arg(chunks) if chunks is not None else -1,
        CHUNKED=chunks is not None,
        OWN_ROWS=own_rows,
        HAS_FAILED=failed is not None,
        SOURCE_UNIT=source_unit,
        OUT_UNIT=out_unit,
        JB=min(4, pow2(num_terms)),
        BLOCK_H=block,
        num_warps=warps,
    )
    return out
