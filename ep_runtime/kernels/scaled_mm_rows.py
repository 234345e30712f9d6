"""The rows around cuBLAS's block-scaled fp8 GEMMs (``experts/scaled_mm.py``): torch specs and
their Triton kernels.

``torch._scaled_mm`` with 1×128 activation scales and 128×128 weight scales takes one expert's
rows as a contiguous ``[M, K]`` e4m3 matrix and their scales as ``[M, K/128]`` *outer-dim major*
(stride ``(1, M)``). So each expert's rows sit in a block of their own, its start and length
padded to ``ROW_ALIGN`` rows, and each block's scales are stored transposed, ``[K/128, M]``
row-major, at ``start·K/128`` of one flat buffer ("block scales").

* ``pad_offsets``: the block starts (each expert's row count rounded up to ``ROW_ALIGN``), in
  one launch.
* ``group_rows``: the dispatched ``q(x)`` rows copied into the blocks (STANDARD's pairs gathered
  by row, EXPANDED's rows as they are), their scales into block scales; padding rows are zero
  with zero scales. Also each block row's pair (STANDARD: ``row·K + slot``; EXPANDED: the
  grouped row; -1 for padding) and each pair's block row (``positions``, -1 where a slot is not
  served here): combine reads it.
* ``activate_rows``: GEMM1's fp32 output → ``q(act)`` (the contract's per-row, per-128-column
  quantizer) and its block scales, each multiplied by the pair's router weight, so GEMM2's
  output rows arrive weighted and combine only adds them.

Deterministic; the Triton kernels read no device value on the host.
"""

from __future__ import annotations

import itertools

import torch

from ep_runtime.kernels.expert_gemm import activation_spec
from ep_runtime.kernels.expert_tile_parts import ADD, activated
from ep_runtime.kernels.fp8_quant import quantize_groups
from ep_runtime.kernels.triton_common import cdiv, jit, kernel, pow2, tl
from ep_runtime.quantization import BLOCK, FP8_DTYPE, quantize_activations

ROW_ALIGN = 16  # rows: every block starts and ends on a multiple (cuBLAS had no kernel for 17)
COPY_BLOCK = 1024  # bytes of a row one step of group_rows copies
MAX_GROUPS = 8  # 128-column groups one program of activate_rows quantizes


def padded_offsets_spec(offsets: torch.Tensor) -> torch.Tensor:
    """``[L + 1]`` int32 block starts: each expert's row count rounded up to ``ROW_ALIGN``."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    padded = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32)


def max_block_rows(num_grouped: int, num_local: int) -> int:
    """A bound on the block rows, ``padded_offsets_spec(offsets)[L]``, for ``offsets[L] ≤
    num_grouped`` (no host read)."""
    return num_grouped + num_local * (ROW_ALIGN - 1)


def block_scales_view(
    flat: torch.Tensor, start: int, end: int, groups: int
) -> torch.Tensor:  # [end - start, groups], strides (1, end - start)
    """One block's scales as ``_scaled_mm``'s outer-dim-major ``scale_a`` (one view op)."""
    rows = end - start
    return flat.as_strided((rows, groups), (1, rows), flat.storage_offset() + start * groups)


def to_block_scales(scales: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """``[P', G]`` row-major scales → the flat block-scale buffer ``[P'·G]`` (spec helper)."""
    groups = scales.size(1)
    flat = scales.new_zeros(scales.size(0) * groups)
    for start, end in itertools.pairwise(bounds):
        block_scales_view(flat, start, end, groups).copy_(scales[start:end])
    return flat


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
    *,
    top_k: int,
    num_slots: int,  # R·K: entries of ``positions``
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows [P', H] e4m3, block scales [P'·H/128] fp32, pair_of [P'] int32, positions [R·K]
    int32)`` for ``P' = padded_offsets_spec(offsets)[L]``."""
    bounds = padded_offsets_spec(offsets).tolist()
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
        to_block_scales(scales, bounds),
        pair.to(torch.int32).to(device),
        positions.to(device),
    )


def activate_rows_spec(
    y: torch.Tensor,  # [P', 2I | I] fp32 GEMM1 output, rows [gate | up] when gated
    pair_of: torch.Tensor,  # [P'] int32, -1 = padding
    weights: torch.Tensor,  # [R, K'] fp32 router weights
    bounds: list[int],  # padded_offsets_spec(offsets) on the host
    *,
    gated: bool,
    sorted_pairs: bool,  # pair_of holds row·K + slot (STANDARD), else the row (EXPANDED)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q(act) [P', I] e4m3, block scales [P'·I/128] fp32 × the pair's router weight)``;
    padding rows are zero codes with zero scales."""
    served = (pair_of >= 0).unsqueeze(1)
    pair = pair_of.long().clamp(min=0)
    weight = weights.reshape(-1)[pair] if sorted_pairs else weights[pair, 0]
    weight = torch.where(served.squeeze(1), weight.float(), 0.0)
    act = activation_spec(torch.where(served, y.float(), 0.0), gated)
    q, s = quantize_activations(act)
    return q, to_block_scales(s * weight.unsqueeze(1), bounds)


# --------------------------------------------------------------------------- Triton kernels


@kernel
def _pad_kernel(offsets, padded, num_local, LP: tl.constexpr, ALIGN: tl.constexpr):
    """One program: the block starts, each expert's row count rounded up, summed in order."""
    e = tl.arange(0, LP)
    ok = e < num_local
    counts = tl.load(offsets + 1 + e, mask=ok, other=0) - tl.load(offsets + e, mask=ok, other=0)
    ends = tl.cumsum((counts + ALIGN - 1) // ALIGN * ALIGN, 0)
    tl.store(padded + 1 + e, ends, mask=ok)
    tl.store(padded + e, tl.zeros_like(e), mask=e == 0)


@jit
def _block_of(padded, p, num_local, LP: tl.constexpr):
    """Block row ``p`` → (expert, block start, block rows)."""
    e = tl.arange(0, LP)
    ends = tl.load(padded + 1 + e, mask=e < num_local, other=2147483647)
    expert = tl.reduce((ends <= p).to(tl.int32), 0, ADD)
    start = tl.load(padded + expert)
    return expert, start, tl.load(padded + expert + 1) - start


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
    block_scales,  # [P'·G] fp32
    pair_of,  # [P'] int32
    positions,  # [R·K] int32, -1 beforehand
    num_local,
    top_k,
    width,
    groups,
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
    tl.store(
        block_scales + start.to(tl.int64) * groups + g * block_rows + i, scale, mask=g < groups
    )
    tl.store(pair_of + p, pair)
    tl.store(positions + pair, p, mask=served)


@kernel
def _activate_kernel(
    y,  # [P', 2I | I] fp32
    stride_y,
    pair_of,  # [P'] int32
    weights,  # [R, K'] fp32
    stride_wr,
    stride_wk,
    padded,  # [L + 1] int32
    q,  # [P', I] e4m3
    stride_q,
    block_scales,  # [P'·I/128] fp32
    num_local,
    top_k,
    width,  # I
    groups,  # I / 128
    GATED: tl.constexpr,
    SORTED: tl.constexpr,
    LP: tl.constexpr,
    GP: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Program = (block row, GP groups of 128 columns): activation, quantization, weight."""
    p = tl.program_id(0)
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
    gate = tl.load(row + cols, mask=ok, other=0.0)
    up = gate
    if GATED:
        up = tl.load(row + width + cols, mask=ok, other=0.0)
    codes, scale = quantize_groups(activated(gate, up, GATED), 1)
    tl.store(q + p.to(tl.int64) * stride_q + cols, codes, mask=(g < groups)[:, None])
    target = block_scales + start.to(tl.int64) * groups + g * block_rows + (p - start)
    tl.store(target, scale * weight, mask=g < groups)


# --------------------------------------------------------------------------- launchers


def pad_offsets(offsets: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    """``padded_offsets_spec(offsets)`` into ``padded`` ([L + 1] int32), in one launch (the
    spec's ten small ops cost the host more than the whole launch)."""
    num_local = offsets.numel() - 1
    _pad_kernel[(1,)](offsets, padded, num_local, LP=pow2(num_local), ALIGN=ROW_ALIGN)
    return padded


def group_rows(
    x_q: torch.Tensor,  # [R, H] e4m3 (columns contiguous)
    x_s: torch.Tensor,  # [R, H/128] fp32 (columns contiguous)
    pairs: torch.Tensor | None,  # [P] int32 or None
    offsets: torch.Tensor,  # [L + 1] int32
    padded: torch.Tensor,  # [L + 1] int32, pad_offsets' output
    rows: torch.Tensor,  # [≥ P', H] e4m3 out: max_block_rows rows (the grid)
    block_scales: torch.Tensor,  # [≥ P'·H/128] fp32 out
    pair_of: torch.Tensor,  # [≥ P'] int32 out
    positions: torch.Tensor,  # [R·K] int32 out
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
        rows.stride(0), block_scales, pair_of, positions, num_local, top_k, width, groups,
        SORTED=pairs is not None, LP=pow2(num_local), BLOCK_C=min(COPY_BLOCK, pow2(width)),
        GP=pow2(groups), num_warps=4,
    )  # fmt: skip


def activate_rows(
    y: torch.Tensor,  # [P', 2I | I] fp32
    pair_of: torch.Tensor,  # [P'] int32
    weights: torch.Tensor,  # [R, K'] fp32 (a strided view is fine)
    padded: torch.Tensor,  # [L + 1] int32
    q: torch.Tensor,  # [P', I] e4m3 out
    block_scales: torch.Tensor,  # [P'·I/128] fp32 out
    *,
    top_k: int,
    gated: bool,
    sorted_pairs: bool,
) -> None:
    """``activate_rows_spec`` into the given buffers, in one launch (silu's exp may differ from
    torch's in the last bit, so a code may land on its e4m3 neighbour)."""
    total, width = q.shape
    if total == 0:
        return
    num_local = padded.numel() - 1
    groups = width // BLOCK
    per_program = min(pow2(groups), MAX_GROUPS)
    _activate_kernel[(total, cdiv(groups, per_program))](
        y, y.stride(0), pair_of, weights, weights.stride(0), weights.stride(1), padded, q,
        q.stride(0), block_scales, num_local, top_k, width, groups, GATED=gated,
        SORTED=sorted_pairs, LP=pow2(num_local), GP=per_program, GROUP=BLOCK, num_warps=4,
    )  # fmt: skip
