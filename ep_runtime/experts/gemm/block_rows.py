"""The rows around the block-scaled fp8 GEMMs that take each expert's rows as one block
(``experts/scaled_mm.py``: cuBLAS per expert; ``experts/deepgemm.py``: DeepGEMM's m-grouped
GEMM): torch specs and their Triton kernels.

Each expert's rows sit in a block of their own, its start padded to ``BlockLayout.align`` rows,
with the 1×128 activation scales *outer-dim major* (the row index fastest), as both libraries
take them. A ``BlockLayout`` says where the scales go:

* ``CUBLAS``: ``torch._scaled_mm`` takes one block as a contiguous ``[M, K]`` matrix and its
  scales as ``[M, K/128]`` with stride ``(1, M)``, so each block's scales are stored transposed,
  ``[K/128, M]`` row-major, at ``start·K/128`` of one flat buffer; blocks are 16-row aligned
  (cuBLAS had no kernel for 17 rows).
* ``DEEPGEMM``: one GEMM over all blocks takes all rows' scales as one ``[P, K/128]`` matrix
  with stride ``(1, S)``, ``S`` = P rounded up to 4 (TMA's 16-byte alignment: ``scale_stride``);
  blocks are 128-row aligned (its M tile), and the GEMM reads each expert's end row
  (``ends``, its "psum" layout) from the device.

* ``pad_offsets``: the block starts (each expert's row count rounded up to the alignment), and
  optionally each expert's end row, in one launch.
* ``group_rows``: the dispatched ``q(x)`` rows copied into the blocks (STANDARD's pairs gathered
  by row, EXPANDED's rows as they are), their scales into block scales; padding rows are zero
  with zero scales. Also each block row's pair (STANDARD: ``row·K + slot``; EXPANDED: the
  grouped row; -1 for padding) and each pair's block row (``positions``, -1 where a slot is not
  served here): combine reads it.
* ``activate_rows``: GEMM1's output (fp32 from cuBLAS, bf16 from DeepGEMM) → ``q(act)`` (the
  contract's per-row, per-128-column quantizer) and its block scales, each multiplied by the
  pair's router weight, so GEMM2's output rows arrive weighted and combine only adds them.

Deterministic; the Triton kernels read no device value on the host: their grids are bounds
(``max_block_rows``), and programs past the last block row return at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ep_runtime.experts.gemm.expert_gemm import activation_spec
from ep_runtime.experts.gemm.expert_tile_parts import ADD, activated
from ep_runtime.kernels.fp8_quant import quantize_groups
from ep_runtime.kernels.triton_common import cdiv, jit, kernel, pow2, tl
from ep_runtime.quantization import BLOCK, FP8_DTYPE, quantize_activations

COPY_BLOCK = 1024  # bytes of a row one step of group_rows copies
MAX_GROUPS = 8  # 128-column groups one program of activate_rows quantizes
SCALE_ALIGN = 4  # fp32 scales: a TMA row of them starts on 16 bytes


@dataclass(frozen=True)
class BlockLayout:
    """Where a GEMM library wants the blocks and their scales (module docstring)."""

    align: int  # rows: every block starts on a multiple
    per_block_scales: bool  # each block's scales transposed at start·G (else one [G, S] matrix)

    def scale_stride(self, rows: int) -> int:
        """``S`` for a buffer of ``rows`` block rows: its scales take ``G·S`` floats."""
        return rows if self.per_block_scales else -(-rows // SCALE_ALIGN) * SCALE_ALIGN


CUBLAS = BlockLayout(align=16, per_block_scales=True)
DEEPGEMM = BlockLayout(align=128, per_block_scales=False)


def padded_offsets_spec(offsets: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[L + 1]`` int32 block starts: each expert's row count rounded up to the alignment."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    padded = (counts + layout.align - 1) // layout.align * layout.align
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32)


def block_ends_spec(offsets: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[L]`` int32: each expert's last block row + 1 (block start + its row count)."""
    return padded_offsets_spec(offsets, layout)[:-1] + (offsets[1:] - offsets[:-1])


def max_block_rows(num_grouped: int, num_local: int, layout: BlockLayout) -> int:
    """A bound on the block rows, ``padded_offsets_spec(offsets)[L]``, for ``offsets[L] ≤
    num_grouped`` (no host read)."""
    return num_grouped + num_local * (layout.align - 1)


def block_scales_view(
    flat: torch.Tensor, start: int, end: int, groups: int
) -> torch.Tensor:  # [end - start, groups], strides (1, end - start)
    """One block's scales as ``_scaled_mm``'s outer-dim-major ``scale_a`` (one view op)."""
    rows = end - start
    return flat.as_strided((rows, groups), (1, rows), flat.storage_offset() + start * groups)


def to_block_scales(
    scales: torch.Tensor, bounds: list[int], layout: BlockLayout
) -> torch.Tensor:  # [G·S] fp32
    """``[P', G]`` row-major scales → the flat scale buffer of ``layout`` (spec helper)."""
    rows, groups = scales.shape
    stride = layout.scale_stride(rows)
    flat = scales.new_zeros(groups * stride)
    if not layout.per_block_scales:
        flat.view(groups, stride)[:, :rows].copy_(scales.t())
        return flat
    for start, end in itertools.pairwise(bounds):
        block_scales_view(flat, start, end, groups).copy_(scales[start:end])
    return flat


def scales_by_row(
    flat: torch.Tensor, bounds: list[int], groups: int, layout: BlockLayout
) -> torch.Tensor:  # [P', G]
    """The inverse of ``to_block_scales``: ``[P', G]``, one row per block row."""
    rows = bounds[-1]
    if not layout.per_block_scales:
        return flat.view(groups, -1)[:, :rows].t()
    return torch.cat([block_scales_view(flat, a, b, groups) for a, b in itertools.pairwise(bounds)])


# --------------------------------------------------------------------------- torch specs


def _block_rows(
    offsets: list[int], bounds: list[int], pairs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pair of each block row [P'], grouped index of each block row [P'])``, -1 for padding."""
    total = bounds[-1]
    pair = torch.full((total,), -1, dtype=torch.int64)
    grouped = torch.full((total,), -1, dtype=torch.int64)
    sorted_pairs = None if pairs is None else pairs.cpu().long()
    for expert, start in enumerate(bounds[:-1]):
        first, count = offsets[expert], offsets[expert + 1] - offsets[expert]
        index = torch.arange(first, first + count)
        grouped[start : start + count] = index
        pair[start : start + count] = index if sorted_pairs is None else sorted_pairs[index]
    return pair, grouped


def group_rows_spec(
    x_q: torch.Tensor,  # [R, H] e4m3
    x_s: torch.Tensor,  # [R, H/128] fp32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot (STANDARD); None: grouped row p is row p
    offsets: torch.Tensor,  # [L + 1] int32 group starts
    layout: BlockLayout,
    *,
    top_k: int,
    num_slots: int,  # R·K: entries of ``positions``
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows [P', H] e4m3, scales [G·S] fp32, pair_of [P'] int32, positions [R·K] int32)``
    for ``P' = padded_offsets_spec(offsets)[L]``."""
    bounds = padded_offsets_spec(offsets, layout).tolist()
    pair, grouped = _block_rows(offsets.tolist(), bounds, pairs)
    served = pair >= 0
    source = torch.where(served, pair // top_k if pairs is not None else grouped, 0)
    device = x_q.device
    source, served_d = source.to(device), served.to(device)
    rows = torch.where(served_d.unsqueeze(1), x_q[source].view(torch.uint8), 0)
    scales = torch.where(served_d.unsqueeze(1), x_s[source], 0.0)
    positions = torch.full((num_slots,), -1, dtype=torch.int32)
    positions[pair[served]] = torch.arange(bounds[-1], dtype=torch.int32)[served]
    return (
        rows.view(FP8_DTYPE),
        to_block_scales(scales, bounds, layout),
        pair.to(torch.int32).to(device),
        positions.to(device),
    )


def activate_rows_spec(
    y: torch.Tensor,  # [P', 2I | I] fp32 or bf16 GEMM1 output, rows [gate | up] when gated
    pair_of: torch.Tensor,  # [P'] int32, -1 = padding
    weights: torch.Tensor,  # [R, K'] fp32 router weights
    bounds: list[int],  # padded_offsets_spec(offsets) on the host
    layout: BlockLayout,
    *,
    gated: bool,
    sorted_pairs: bool,  # pair_of holds row·K + slot (STANDARD), else the row (EXPANDED)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q(act) [P', I] e4m3, scales [G·S] fp32 × the pair's router weight)``; padding rows
    are zero codes with zero scales."""
    served = (pair_of >= 0).unsqueeze(1)
    pair = pair_of.long().clamp(min=0)
    weight = weights.reshape(-1)[pair] if sorted_pairs else weights[pair, 0]
    weight = torch.where(served.squeeze(1), weight.float(), 0.0)
    act = activation_spec(torch.where(served, y.float(), 0.0), gated)
    q, s = quantize_activations(act)
    return q, to_block_scales(s * weight.unsqueeze(1), bounds, layout)


# --------------------------------------------------------------------------- Triton kernels


@kernel
def _pad_kernel(
    offsets, padded, ends, num_local, LP: tl.constexpr, ALIGN: tl.constexpr, ENDS: tl.constexpr
):
    """One program: the block starts, each expert's row count rounded up, summed in order;
    ENDS: each block's start + its row count too."""
    e = tl.arange(0, LP)
    ok = e < num_local
    counts = tl.load(offsets + 1 + e, mask=ok, other=0) - tl.load(offsets + e, mask=ok, other=0)
    padded_counts = (counts + ALIGN - 1) // ALIGN * ALIGN
    block_ends = tl.cumsum(padded_counts, 0)
    tl.store(padded + 1 + e, block_ends, mask=ok)
    tl.store(padded + e, tl.zeros_like(e), mask=e == 0)
    if ENDS:
        tl.store(ends + e, block_ends - padded_counts + counts, mask=ok)


@jit
def _block_of(padded, p, num_local, LP: tl.constexpr):
    """Block row ``p`` → (expert, block start, block rows)."""
    e = tl.arange(0, LP)
    ends = tl.load(padded + 1 + e, mask=e < num_local, other=2147483647)
    expert = tl.reduce((ends <= p).to(tl.int32), 0, ADD)
    start = tl.load(padded + expert)
    return expert, start, tl.load(padded + expert + 1) - start


@jit
def _scale_target(
    block_scales, scale_stride, p, start, block_rows, g, groups, PER_BLOCK: tl.constexpr
):
    """Where block row ``p``'s scales of groups ``g`` go (module docstring)."""
    if PER_BLOCK:
        return block_scales + start.to(tl.int64) * groups + g * block_rows + (p - start)
    return block_scales + g.to(tl.int64) * scale_stride + p


@kernel
def _group_kernel(
    x,  # [R, H] uint8 (e4m3 codes)
    stride_x,
    x_s,  # [R, G] fp32
    stride_xs,
    pairs,  # [P] int32 (SORTED) or unused
    offsets,  # [L + 1] int32
    padded,  # [L + 1] int32
    rows,  # [P', H] uint8
    stride_rows,
    block_scales,  # [G·S] fp32
    scale_stride,  # S (global scales)
    pair_of,  # [P'] int32
    positions,  # [R·K] int32, -1 beforehand
    num_local,
    top_k,
    width,
    groups,
    PER_BLOCK: tl.constexpr,
    SORTED: tl.constexpr,
    LP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GP: tl.constexpr,
):
    """Program = one block row: its source row copied (zero for padding), scales, maps. The
    grid is a bound on the block rows (the host has not read their count): past them, nothing."""
    p = tl.program_id(0)
    if p >= tl.load(padded + num_local):
        return
    expert, start, block_rows = _block_of(padded, p, num_local, LP)
    i = p - start
    first = tl.load(offsets + expert)
    served = i < tl.load(offsets + expert + 1) - first
    if SORTED:
        pair = tl.load(pairs + first + i, mask=served, other=-1)
        source = (pair // top_k).to(tl.int64)
    else:
        pair = tl.where(served, first + i, -1)
        source = (first + i).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    for c0 in range(0, width, BLOCK_C):
        ok = c0 + c < width
        codes = tl.load(x + source * stride_x + c0 + c, mask=ok & served, other=0)
        tl.store(rows + p.to(tl.int64) * stride_rows + c0 + c, codes, mask=ok)
    g = tl.arange(0, GP)
    scale = tl.load(x_s + source * stride_xs + g, mask=(g < groups) & served, other=0.0)
    target = _scale_target(block_scales, scale_stride, p, start, block_rows, g, groups, PER_BLOCK)
    tl.store(target, scale, mask=g < groups)
    tl.store(pair_of + p, pair)
    tl.store(positions + pair, p, mask=served)


@kernel
def _activate_kernel(
    y,  # [P', 2I | I] fp32 or bf16
    stride_y,
    pair_of,  # [P'] int32
    weights,  # [R, K'] fp32
    stride_wr,
    stride_wk,
    padded,  # [L + 1] int32
    q,  # [P', I] e4m3
    stride_q,
    block_scales,  # [G·S] fp32
    scale_stride,  # S (global scales)
    num_local,
    top_k,
    width,  # I
    groups,  # I / 128
    PER_BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    SORTED: tl.constexpr,
    LP: tl.constexpr,
    GP: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Program = (block row, GP groups of 128 columns): activation, quantization, weight. The
    grid may be a bound on the block rows: past them, nothing."""
    p = tl.program_id(0)
    if p >= tl.load(padded + num_local):
        return
    _, start, block_rows = _block_of(padded, p, num_local, LP)
    pair = tl.load(pair_of + p)
    served = pair >= 0
    if SORTED:
        where = (pair // top_k).to(tl.int64) * stride_wr + (pair % top_k) * stride_wk
    else:
        where = pair.to(tl.int64) * stride_wr
    weight = tl.load(weights + where, mask=served, other=0.0)
    g = tl.program_id(1) * GP + tl.arange(0, GP)
    ok = (g < groups)[:, None] & served
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GP, GROUP]
    row = y + p.to(tl.int64) * stride_y
    gate = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
    up = gate
    if GATED:
        up = tl.load(row + width + cols, mask=ok, other=0.0).to(tl.float32)
    codes, scale = quantize_groups(activated(gate, up, GATED), 1)
    tl.store(q + p.to(tl.int64) * stride_q + cols, codes, mask=(g < groups)[:, None])
    target = _scale_target(block_scales, scale_stride, p, start, block_rows, g, groups, PER_BLOCK)
    tl.store(target, scale * weight, mask=g < groups)


# --------------------------------------------------------------------------- launchers


def pad_offsets(
    offsets: torch.Tensor,  # [L + 1] int32
    padded: torch.Tensor,  # [L + 1] int32 out
    layout: BlockLayout,
    ends: torch.Tensor | None = None,  # [L] int32 out: block_ends_spec
) -> torch.Tensor:
    """``padded_offsets_spec(offsets)`` into ``padded`` (and ``block_ends_spec`` into ``ends``),
    in one launch (the specs' small ops cost the host more than the whole launch)."""
    num_local = offsets.numel() - 1
    _pad_kernel[(1,)](
        offsets, padded, padded if ends is None else ends, num_local, LP=pow2(num_local),
        ALIGN=layout.align, ENDS=ends is not None,
    )  # fmt: skip
    return padded


def group_rows(
    x_q: torch.Tensor,  # [R, H] e4m3 (columns contiguous)
    x_s: torch.Tensor,  # [R, H/128] fp32 (columns contiguous)
    pairs: torch.Tensor | None,  # [P] int32 or None
    offsets: torch.Tensor,  # [L + 1] int32
    padded: torch.Tensor,  # [L + 1] int32, pad_offsets' output
    rows: torch.Tensor,  # [≥ P', H] e4m3 out: max_block_rows rows (the grid)
    block_scales: torch.Tensor,  # [G·S] fp32 out, S = layout.scale_stride(rows.size(0))
    pair_of: torch.Tensor,  # [≥ P'] int32 out
    positions: torch.Tensor,  # [R·K] int32 out
    layout: BlockLayout,
    *,
    top_k: int,
) -> None:
    """``group_rows_spec`` into the first ``P'`` rows of the given buffers, bitwise, in one fill
    and one launch, without reading ``P'`` on the host."""
    positions.fill_(-1)
    total, width = rows.shape
    if total == 0:
        return
    num_local = offsets.numel() - 1
    groups = x_s.size(1)
    _group_kernel[(total,)](
        x_q.view(torch.uint8), x_q.stride(0), x_s, x_s.stride(0),
        offsets if pairs is None else pairs, offsets, padded, rows.view(torch.uint8),
        rows.stride(0), block_scales, layout.scale_stride(total), pair_of, positions, num_local,
        top_k, width, groups, PER_BLOCK=layout.per_block_scales, SORTED=pairs is not None,
        LP=pow2(num_local), BLOCK_C=min(COPY_BLOCK, pow2(width)), GP=pow2(groups), num_warps=4,
    )  # fmt: skip


def activate_rows(
    y: torch.Tensor,  # [≥ P', 2I | I] fp32 or bf16
    pair_of: torch.Tensor,  # [≥ P'] int32
    weights: torch.Tensor,  # [R, K'] fp32 (a strided view is fine)
    padded: torch.Tensor,  # [L + 1] int32
    q: torch.Tensor,  # [≥ P', I] e4m3 out: P' rows or a bound on them (the grid)
    block_scales: torch.Tensor,  # [G·S] fp32 out, S = layout.scale_stride(q.size(0))
    layout: BlockLayout,
    *,
    top_k: int,
    gated: bool,
    sorted_pairs: bool,
) -> None:
    """``activate_rows_spec`` into the first ``P'`` rows of the given buffers, in one launch
    (silu's exp may differ from torch's in the last bit, so a code may land on its e4m3
    neighbour)."""
    total, width = q.shape
    if total == 0:
        return
    num_local = padded.numel() - 1
    groups = width // BLOCK
    per_program = min(pow2(groups), MAX_GROUPS)
    _activate_kernel[(total, cdiv(groups, per_program))](
        y, y.stride(0), pair_of, weights, weights.stride(0), weights.stride(1), padded, q,
        q.stride(0), block_scales, layout.scale_stride(total), num_local, top_k, width, groups,
        PER_BLOCK=layout.per_block_scales, GATED=gated, SORTED=sorted_pairs,
        LP=pow2(num_local), GP=per_program, GROUP=BLOCK, num_warps=4,
    )  # fmt: skip
