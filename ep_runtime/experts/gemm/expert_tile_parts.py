"""The Triton building blocks both expert GEMMs share (``expert_gemm.py`` in bf16,
``expert_gemm_fp8.py`` in fp8): which tile a program computes and its rows' sources and
targets, the one loop over a program's column tiles and k-steps, the epilogues (activation,
router weight, one rounding), and the launch geometry (the static grid's bound on row tiles)."""

from __future__ import annotations

import torch

from ep_runtime.experts.gemm.expert_tiles import TileConfig
from ep_runtime.kernels.triton_common import HAS_TRITON, INTERPRET, cdiv, exp_fp32, jit, tl
from ep_runtime.kernels.triton_common import rounded as _rounded

# tl.sum's and tl.cumsum's combine function: tl.reduce / tl.associative_scan with it compile the
# same, and under the interpreter skip the costly call of a nested jit function (None without
# Triton, where no kernel runs)
ADD = tl.standard._sum_combine if HAS_TRITON else None


@jit
def expert_tile(
    pid,
    offsets,  # [L + 1] int32
    num_local,
    tiles_m,  # the grid's bound on row tiles
    num_n,  # column tiles
    BM: tl.constexpr,
    GROUP_M: tl.constexpr,
    LP: tl.constexpr,  # L padded to a power of two
):
    """Program ``pid`` → (row tile, column tile, expert, first row tile of the expert, first
    row, end row). Row tiles are numbered expert by expert; groups of GROUP_M row tiles share
    column tiles so their weight tiles meet in L2. Past the real tiles, expert is ≥ L and the
    first row tile is the real tile count. (Few ``tl.sum``-like calls: each is slow under the
    interpreter.)"""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % in_group) % size_m
    tile_n = (pid % in_group) // size_m
    e = tl.arange(0, LP)
    present = e < num_local
    starts = tl.load(offsets + e, mask=present, other=0)
    ends = tl.load(offsets + e + 1, mask=present, other=0)
    tiles = tl.where(present, (ends - starts + BM - 1) // BM, 0)
    expert = tl.reduce((tl.associative_scan(tiles, 0, ADD) <= tile_m).to(tl.int32), 0, ADD)
    first_tile = tl.reduce(tl.where(e < expert, tiles, 0), 0, ADD)
    row_start = 0
    row_end = 0
    if expert < num_local:
        row_start = tl.load(offsets + expert) + (tile_m - first_tile) * BM
        row_end = tl.load(offsets + expert + 1)
    return tile_m, tile_n, expert, first_tile, row_start, row_end


@jit
def row_sources(pairs, p, ok_m, top_k, SORTED: tl.constexpr):
    """int64 ``[BM]`` rows of A that grouped rows ``p`` read: ``pairs[p] // top_k`` (the sorted
    pairs of STANDARD), or ``p`` itself (EXPANDED: rows already grouped)."""
    if SORTED:  # noqa: SIM108 (a constexpr branch: pairs is read only when sorted)
        source = tl.load(pairs + p, mask=ok_m, other=0) // top_k
    else:
        source = p
    return source.to(tl.int64)


@jit
def row_targets(pairs, p, ok_m, top_k, weights, stride_rr, stride_rk, SORTED: tl.constexpr):
    """``(dest [BM] int64, router weight [BM] fp32)`` of grouped rows ``p``: the pair's row of
    the per-pair output and its slot's weight (SORTED), or the row itself and its one weight."""
    if SORTED:
        dest = tl.load(pairs + p, mask=ok_m, other=0)
        row = dest // top_k
        slot = dest % top_k
    else:
        dest = p
        row = p
        slot = 0
    weight = tl.load(weights + row * stride_rr + slot * stride_rk, mask=ok_m, other=0.0)
    return dest.to(tl.int64), weight.to(tl.float32)


@jit
def zero_padding_tiles(
    out,
    stride_om,
    offsets,
    num_local,
    tile_m,
    first_tile,
    num_rows,
    column_group,
    width,
    BM: tl.constexpr,
    BN: tl.constexpr,
    TILES_N: tl.constexpr,
):
    """A spare program (past the real ones) zeroes EXPANDED padding tile ``tile_m - first_tile``
    in its column tiles: rows from ``offsets[L]`` on, below ``num_rows``."""
    p = tl.load(offsets + num_local) + (tile_m - first_tile) * BM + tl.arange(0, BM)
    o_rows = out + p.to(tl.int64)[:, None] * stride_om
    zero = tl.zeros((BM, BN), dtype=out.dtype.element_ty)
    for j in tl.static_range(TILES_N):
        n = (column_group * TILES_N + j) * BN + tl.arange(0, BN)
        tl.store(o_rows + n[None, :], zero, mask=(p < num_rows)[:, None] & (n < width)[None, :])


@jit
def group_tiles(column_group, num_n, TILES_N: tl.constexpr):
    """The column tiles of a program's group that lie inside the columns (the last group of a
    row may be partial: its loop stops at the last real tile)."""
    if TILES_N == 1:  # noqa: SIM108 (a constexpr branch: one tile is a compile-time count)
        count = 1
    else:
        count = tl.minimum(TILES_N, num_n - column_group * TILES_N)
    return count


@jit
def column_step(i, steps, column_group, count, TILES_N: tl.constexpr):
    """Step ``i`` of a program's one loop over its ``count`` column tiles × ``steps`` k-steps
    → (column tile, k-step, whether a tile before the program's last ends here). One loop, not
    two nested, so the next tile's weight loads are in flight while a tile's epilogue runs, and
    the program's set-up (its expert, rows and their sources) is paid once for all its tiles.
    With one tile it is the plain k loop; the last tile's epilogue follows the loop."""
    if TILES_N == 1:
        tile_n = column_group
        k_step = i
        flush = False
    else:
        j = i // steps
        k_step = i - j * steps
        tile_n = column_group * TILES_N + j
        flush = (k_step == steps - 1) & (j < count - 1)
    return tile_n, k_step, flush


@jit
def step_masks(ok_m, ok_n, kk, depth_left, EVEN_K: tl.constexpr):
    """Load masks of one k-step: ``[BM, BK]`` rows of A and ``[BK, BN]`` of the weights (rows
    and columns inside the problem, and, unless every step is whole, k below ``depth_left``)."""
    if EVEN_K:
        a_ok = ok_m[:, None]
        w_ok = ok_n[None, :]
    else:
        a_ok = ok_m[:, None] & (kk[None, :] < depth_left)
        w_ok = ok_n[None, :] & (kk[:, None] < depth_left)
    return a_ok, w_ok


@jit
def store_down_tile(out, o_rows, acc, weight, n, ok_m, ok_n, SWAP: tl.constexpr):
    """GEMM2's epilogue of one tile: router weight, one rounding, the rows ``o_rows`` point at."""
    result = untransposed(acc, SWAP) * weight[:, None]
    mask = ok_m[:, None] & ok_n[None, :]
    tl.store(o_rows + n[None, :], _rounded(result, out.dtype.element_ty), mask=mask)


@jit
def flush_down_tile(
    acc, flush, out, o_rows, weight, n, ok_m, ok_n, SWAP: tl.constexpr, TILES_N: tl.constexpr
):
    """Inside the loop: a finished tile before the program's last is stored and its
    accumulator restarted (with one tile per program nothing is compiled here)."""
    if TILES_N > 1:  # noqa: SIM102 (a constexpr branch: one tile compiles without it)
        if flush:
            store_down_tile(out, o_rows, acc, weight, n, ok_m, ok_n, SWAP)
            acc = tl.zeros(acc.shape, dtype=tl.float32)
    return acc


@jit
def store_last_down_tile(
    out, o_rows, acc, weight, last_tile, width, ok_m, BN: tl.constexpr, SWAP: tl.constexpr
):
    """After the loop: the program's last column tile."""
    n = last_tile * BN + tl.arange(0, BN)
    store_down_tile(out, o_rows, acc, weight, n, ok_m, n < width, SWAP)


@jit
def store_up_tile(
    out, o_rows, acc_g, acc_u, n, ok_m, ok_n, GATED: tl.constexpr, SWAP: tl.constexpr
):
    """GEMM1's epilogue of one tile: the activation in fp32, one rounding."""
    result = activated(untransposed(acc_g, SWAP), untransposed(acc_u, SWAP), GATED)
    mask = ok_m[:, None] & ok_n[None, :]
    tl.store(o_rows + n[None, :], _rounded(result, out.dtype.element_ty), mask=mask)


@jit
def activated(acc_g, acc_u, GATED: tl.constexpr):
    """fp32 ``silu(gate)·up`` (GATED) or ``relu(h)²`` of the GEMM1 accumulators."""
    if GATED:
        result = acc_g / (1.0 + exp_fp32(-acc_g)) * acc_u
    else:
        relu = tl.where(acc_g < 0.0, 0.0, acc_g)
        result = relu * relu
    return result


@jit
def tile_step(acc, a, b, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += a · b`` for one k-step (SWAP: the transposed tile ``bᵀ·aᵀ``); under the
    interpreter the operands go to fp32 first (its bf16 ``dot`` is wrong; bf16 → fp32 is exact)."""
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if SWAP:
        acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@jit
def untransposed(acc, SWAP: tl.constexpr):
    """The ``[BM, BN]`` tile of an accumulator kept as ``[BN, BM]`` when SWAP."""
    if SWAP:
        acc = tl.trans(acc)
    return acc


# --------------------------------------------------------------------------- launch geometry


def down_launch(
    num_grouped: int,
    num_local: int,
    width: int,
    pairs: torch.Tensor | None,
    out: torch.Tensor,
    config: TileConfig,
) -> tuple[tuple[int], int] | None:
    """``(grid, tiles_m)`` of a GEMM2 launch (bf16 or fp8), or None when there is nothing to
    compute (no rows or no columns: EXPANDED's output, every row padding, is zeroed here)."""
    if num_grouped == 0 or width == 0:
        if pairs is None:
            out.zero_()
        return None
    tiles_m = row_tiles(num_grouped, num_local, config.block_m)
    return (tiles_m * column_groups(width, config),), tiles_m


def column_groups(width: int, config: TileConfig) -> int:
    """The grid's programs per row tile: ``config.tiles_n`` column tiles each."""
    return cdiv(cdiv(width, config.block_n), config.tiles_n)


def row_tiles(num_grouped: int, num_local: int, block_m: int) -> int:
    """Bound on the row tiles of ``num_grouped`` rows in ``num_local`` groups: each group adds
    at most one partial tile, and every tile holds at least one row. It also leaves at least as
    many spare tiles as there are padding tiles (what ZERO_PAD needs)."""
    return min(cdiv(num_grouped, block_m) + num_local, num_grouped)
