"""The expert GEMMs of the ``triton`` experts backend: their torch spec and their Triton kernels.

Both GEMMs walk grouped rows: rows ``[offsets[e], offsets[e+1])`` belong to local expert ``e``;
rows past ``offsets[L]`` are padding and are never read. A grouped row ``p`` is either a row of
the input itself (EXPANDED: the dispatcher grouped them) or, through ``pairs[p] = row·K + slot``
(STANDARD: ``kernels/expert_rows.py`` sorted the served (row, slot) pairs by expert), a pair whose
hidden state is read straight from the received rows, with no copy.

* ``expert_up``: ``act[p] = act(x[row(p)] · w13[e]ᵀ)`` in fp32 (gated: ``silu(gate)·up`` with
  ``w13`` rows ``[gate; up]``; else ``relu(h)²``), rounded once to ``[P, I]``.
* ``expert_down``: ``y = weight(p) · (act[p] · w2[e]ᵀ)`` in fp32, rounded once, written to the
  pair's row ``row·K + slot`` (STANDARD) or to row ``p`` (EXPANDED, where padding rows get
  zeros, written without reading anything).

No atomics and a fixed accumulation order per config: two runs are bitwise equal. The grid is
static (a bound on the tiles; tiles past the real count exit or zero padding), so nothing is
read on the host and a CUDA graph can capture it. Under ``TRITON_INTERPRET=1`` the kernels run
on CPU tensors (the interpreter's bf16 ``dot`` is wrong, so there operands go to fp32 first:
exact, since bf16 → fp32 is).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ep_runtime.kernels.expert_tiles import TileConfig
from ep_runtime.kernels.triton_common import INTERPRET, cdiv, exp_fp32, kernel, pow2
from ep_runtime.kernels.triton_common import rounded as _rounded

# --------------------------------------------------------------------------- torch spec


def _activate(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """fp32 ``silu(gate)·up`` (``h = [gate | up]``) or ``relu(h)²``."""
    if gated:
        half = h.size(1) // 2
        return torch.nn.functional.silu(h[:, :half]) * h[:, half:]
    return torch.relu(h).square()


def _groups(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every non-empty group (reads offsets on the host)."""
    bounds = offsets.tolist()
    return [(e, s, t) for e, (s, t) in enumerate(itertools.pairwise(bounds)) if t > s]


def expert_up_spec(
    x: torch.Tensor,  # [R, H]
    w13: torch.Tensor,  # [L, 2I | I, H]
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot per grouped row; None: row p is x[p]
    *,
    top_k: int,
    gated: bool,
) -> torch.Tensor:
    """``[P, I]`` in x's dtype; rows past ``offsets[L]`` are zero here (unwritten by the kernel)."""
    num_grouped = x.size(0) if pairs is None else pairs.numel()
    width = w13.size(1) // 2 if gated else w13.size(1)
    out = torch.zeros(num_grouped, width, dtype=x.dtype, device=x.device)
    for expert, start, end in _groups(offsets):
        source = torch.arange(start, end, device=x.device)
        if pairs is not None:
            source = pairs[start:end].long() // top_k
        h = x[source].float() @ w13[expert].float().T
        out[start:end] = _activate(h, gated).to(x.dtype)
    return out


def expert_down_spec(
    act: torch.Tensor,  # [P, I]
    w2: torch.Tensor,  # [L, H, I]
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is output row p
    weights: torch.Tensor,  # [R, K'] fp32 router weights
    *,
    num_out: int,  # output rows: R·K (pairs) or R
) -> torch.Tensor:
    """``[num_out, H]``: each grouped row's weighted result at its row; every other row zero."""
    out = torch.zeros(num_out, w2.size(1), dtype=act.dtype, device=act.device)
    for expert, start, end in _groups(offsets):
        dest = torch.arange(start, end, device=act.device)
        if pairs is not None:
            dest = pairs[start:end].long()
        weight = weights.reshape(-1)[dest] if pairs is not None else weights[dest, 0]
        y = act[start:end].float() @ w2[expert].float().T
        out[dest] = (y * weight.float().unsqueeze(1)).to(act.dtype)
    return out


# --------------------------------------------------------------------------- Triton kernels

# tl.sum's and tl.cumsum's combine function: tl.reduce / tl.associative_scan with it compile the
# same, and under the interpreter skip the costly call of a nested jit function
ADD = tl.standard._sum_combine


@triton.jit
def _expert_tile(
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


@triton.jit
def _row_sources(pairs, p, ok_m, top_k, SORTED: tl.constexpr):
    """int64 ``[BM]`` rows of A that grouped rows ``p`` read: ``pairs[p] // top_k`` (the sorted
    pairs of STANDARD), or ``p`` itself (EXPANDED: rows already grouped)."""
    if SORTED:  # noqa: SIM108 (a constexpr branch: pairs is read only when sorted)
        source = tl.load(pairs + p, mask=ok_m, other=0) // top_k
    else:
        source = p
    return source.to(tl.int64)


@triton.jit
def _row_targets(pairs, p, ok_m, top_k, weights, stride_rr, stride_rk, SORTED: tl.constexpr):
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


@triton.jit
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


@triton.jit
def _group_tiles(column_group, num_n, TILES_N: tl.constexpr):
    """The column tiles of a program's group that lie inside the columns (the last group of a
    row may be partial: its loop stops at the last real tile)."""
    if TILES_N == 1:  # noqa: SIM108 (a constexpr branch: one tile is a compile-time count)
        count = 1
    else:
        count = tl.minimum(TILES_N, num_n - column_group * TILES_N)
    return count


@triton.jit
def _column_step(i, steps, column_group, count, TILES_N: tl.constexpr):
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


@triton.jit
def store_down_tile(out, o_rows, acc, weight, n, ok_m, ok_n, SWAP: tl.constexpr):
    """GEMM2's epilogue of one tile: router weight, one rounding, the rows ``o_rows`` point at."""
    result = untransposed(acc, SWAP) * weight[:, None]
    mask = ok_m[:, None] & ok_n[None, :]
    tl.store(o_rows + n[None, :], _rounded(result, out.dtype.element_ty), mask=mask)


@triton.jit
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


@triton.jit
def store_last_down_tile(
    out, o_rows, acc, weight, last_tile, width, ok_m, BN: tl.constexpr, SWAP: tl.constexpr
):
    """After the loop: the program's last column tile."""
    n = last_tile * BN + tl.arange(0, BN)
    store_down_tile(out, o_rows, acc, weight, n, ok_m, n < width, SWAP)


@triton.jit
def _store_up_tile(
    out, o_rows, acc_g, acc_u, n, ok_m, ok_n, GATED: tl.constexpr, SWAP: tl.constexpr
):
    """GEMM1's epilogue of one tile: the activation in fp32, one rounding."""
    result = activated(untransposed(acc_g, SWAP), untransposed(acc_u, SWAP), GATED)
    mask = ok_m[:, None] & ok_n[None, :]
    tl.store(o_rows + n[None, :], _rounded(result, out.dtype.element_ty), mask=mask)


@triton.jit
def activated(acc_g, acc_u, GATED: tl.constexpr):
    """fp32 ``silu(gate)·up`` (GATED) or ``relu(h)²`` of the GEMM1 accumulators."""
    if GATED:
        result = acc_g / (1.0 + exp_fp32(-acc_g)) * acc_u
    else:
        relu = tl.where(acc_g < 0.0, 0.0, acc_g)
        result = relu * relu
    return result


@triton.jit
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


@triton.jit
def untransposed(acc, SWAP: tl.constexpr):
    """The ``[BM, BN]`` tile of an accumulator kept as ``[BN, BM]`` when SWAP."""
    if SWAP:
        acc = tl.trans(acc)
    return acc


@kernel(do_not_specialize=["tiles_m"])  # it varies with the rows: one compile serves all
def _up_kernel(
    x,  # [R, H]
    stride_xm,
    stride_xk,
    pairs,  # [P] int32 (SORTED)
    offsets,  # [L + 1] int32
    w,  # [L, 2I | I, H]
    stride_we,
    stride_wn,
    stride_wk,
    out,  # [P, I]
    stride_om,
    num_local,
    top_k,
    width,  # I
    depth,  # H
    tiles_m,
    GATED: tl.constexpr,
    SORTED: tl.constexpr,
    SWAP: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TILES_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    LP: tl.constexpr,
):
    """Program (row tile, TILES_N column tiles): A rows gathered through ``pairs``, fp32
    epilogue per column tile."""
    num_n = (width + BN - 1) // BN
    _, column_group, expert, _, row_start, row_end = _expert_tile(
        tl.program_id(0), offsets, num_local, tiles_m, (num_n + TILES_N - 1) // TILES_N, BM,
        GROUP_M, LP,
    )  # fmt: skip
    if expert < num_local:
        p = row_start + tl.arange(0, BM)
        ok_m = p < row_end
        source = _row_sources(pairs, p, ok_m, top_k, SORTED)
        kk = tl.arange(0, BK)
        a_rows = x + source[:, None] * stride_xm + kk[None, :] * stride_xk
        w_expert = w + expert.to(tl.int64) * stride_we + kk[:, None] * stride_wk
        o_rows = out + p.to(tl.int64)[:, None] * stride_om
        steps = (depth + BK - 1) // BK
        shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
        acc_g = tl.zeros(shape, dtype=tl.float32)
        acc_u = tl.zeros(shape, dtype=tl.float32)
        count = _group_tiles(column_group, num_n, TILES_N)
        for i in range(0, count * steps):
            tile_n, k_step, flush = _column_step(i, steps, column_group, count, TILES_N)
            n = tile_n * BN + tl.arange(0, BN)
            ok_n = n < width
            if EVEN_K:
                a_ok = ok_m[:, None]
                w_ok = ok_n[None, :]
            else:
                a_ok = ok_m[:, None] & (kk[None, :] < depth - k_step * BK)
                w_ok = ok_n[None, :] & (kk[:, None] < depth - k_step * BK)
            a = tl.load(a_rows + k_step * BK * stride_xk, mask=a_ok, other=0.0)
            g_ptrs = w_expert + n[None, :] * stride_wn + k_step * BK * stride_wk
            acc_g = tile_step(acc_g, a, tl.load(g_ptrs, mask=w_ok, other=0.0), SWAP, PRECISION)
            if GATED:
                u = tl.load(g_ptrs + width * stride_wn, mask=w_ok, other=0.0)
                acc_u = tile_step(acc_u, a, u, SWAP, PRECISION)
            if TILES_N > 1:  # noqa: SIM102 (a constexpr branch: one tile compiles without it)
                if flush:
                    _store_up_tile(out, o_rows, acc_g, acc_u, n, ok_m, ok_n, GATED, SWAP)
                    acc_g = tl.zeros(shape, dtype=tl.float32)
                    acc_u = tl.zeros(shape, dtype=tl.float32)
        n = (column_group * TILES_N + count - 1) * BN + tl.arange(0, BN)
        _store_up_tile(out, o_rows, acc_g, acc_u, n, ok_m, n < width, GATED, SWAP)


@kernel(do_not_specialize=["tiles_m", "num_rows"])
def _down_kernel(
    act,  # [P, I]
    stride_am,
    pairs,  # [P] int32 (SORTED)
    offsets,  # [L + 1] int32
    w,  # [L, H, I]
    stride_we,
    stride_wn,
    stride_wk,
    weights,  # [R, K'] fp32
    stride_rr,
    stride_rk,
    out,  # [R·K, H] (SORTED) or [R, H]
    stride_om,
    num_local,
    top_k,
    width,  # H
    depth,  # I
    tiles_m,
    num_rows,  # R: rows of out to zero past offsets[L] (ZERO_PAD)
    SORTED: tl.constexpr,
    ZERO_PAD: tl.constexpr,
    SWAP: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TILES_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    LP: tl.constexpr,
):
    """Program (row tile, TILES_N column tiles): router weight and one rounding in each tile's
    epilogue. A program past the real ones zeroes padding tile ``tile_m - total`` (ZERO_PAD):
    the grid bound leaves at least as many spare tiles as padding tiles."""
    num_n = (width + BN - 1) // BN
    tile_m, column_group, expert, first_tile, row_start, row_end = _expert_tile(
        tl.program_id(0), offsets, num_local, tiles_m, (num_n + TILES_N - 1) // TILES_N, BM,
        GROUP_M, LP,
    )  # fmt: skip
    if expert < num_local:
        p = row_start + tl.arange(0, BM)
        ok_m = p < row_end
        dest, weight = _row_targets(pairs, p, ok_m, top_k, weights, stride_rr, stride_rk, SORTED)
        o_rows = out + dest[:, None] * stride_om
        kk = tl.arange(0, BK)
        a_rows = act + p.to(tl.int64)[:, None] * stride_am + kk[None, :]
        w_expert = w + expert.to(tl.int64) * stride_we + kk[:, None] * stride_wk
        steps = (depth + BK - 1) // BK
        shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
        acc = tl.zeros(shape, dtype=tl.float32)
        count = _group_tiles(column_group, num_n, TILES_N)
        for i in range(0, count * steps):
            tile_n, k_step, flush = _column_step(i, steps, column_group, count, TILES_N)
            n = tile_n * BN + tl.arange(0, BN)
            ok_n = n < width
            if EVEN_K:
                a_ok = ok_m[:, None]
                w_ok = ok_n[None, :]
            else:
                a_ok = ok_m[:, None] & (kk[None, :] < depth - k_step * BK)
                w_ok = ok_n[None, :] & (kk[:, None] < depth - k_step * BK)
            a = tl.load(a_rows + k_step * BK, mask=a_ok, other=0.0)
            b_ptrs = w_expert + n[None, :] * stride_wn + k_step * BK * stride_wk
            acc = tile_step(acc, a, tl.load(b_ptrs, mask=w_ok, other=0.0), SWAP, PRECISION)
            acc = flush_down_tile(acc, flush, out, o_rows, weight, n, ok_m, ok_n, SWAP, TILES_N)
        last_tile = column_group * TILES_N + count - 1
        store_last_down_tile(out, o_rows, acc, weight, last_tile, width, ok_m, BN, SWAP)
    elif ZERO_PAD:
        zero_padding_tiles(
            out, stride_om, offsets, num_local, tile_m, first_tile, num_rows, column_group,
            width, BM, BN, TILES_N,
        )  # fmt: skip


# --------------------------------------------------------------------------- launchers


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


def _launch_options(config: TileConfig, num_local: int, depth: int, dtype: torch.dtype) -> dict:
    return {
        "SWAP": config.swap,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "EVEN_K": depth % config.block_k == 0,
        "BM": config.block_m,
        "BN": config.block_n,
        "BK": config.block_k,
        "TILES_N": config.tiles_n,
        "GROUP_M": config.group_m,
        "LP": pow2(num_local),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def expert_up(
    x: torch.Tensor,  # [R, H] (rows may be strided)
    w13: torch.Tensor,  # [L, 2I | I, H]
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is x[p]
    out: torch.Tensor,  # [P, I] written for rows < offsets[L]
    *,
    top_k: int,
    gated: bool,
    config: TileConfig,
) -> torch.Tensor:
    num_grouped, width = out.shape
    num_local, _, depth = w13.shape
    if num_grouped == 0 or width == 0:
        return out
    tiles_m = row_tiles(num_grouped, num_local, config.block_m)
    grid = (tiles_m * column_groups(width, config),)
    _up_kernel[grid](
        x,
        x.stride(0),
        x.stride(1),
        offsets if pairs is None else pairs,
        offsets,
        w13,
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        out,
        out.stride(0),
        num_local,
        top_k,
        width,
        depth,
        tiles_m,
        GATED=gated,
        SORTED=pairs is not None,
        **_launch_options(config, num_local, depth, x.dtype),
    )
    return out


def expert_down(
    act: torch.Tensor,  # [P, I]
    w2: torch.Tensor,  # [L, H, I]
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is out row p
    weights: torch.Tensor,  # [R, K'] fp32 router weights (a strided view is fine)
    out: torch.Tensor,  # [R·K, H] (pairs) or [R, H] (every row written: padding zero)
    *,
    config: TileConfig,
) -> torch.Tensor:
    num_grouped, depth = act.shape
    num_local, width, _ = w2.shape
    launch = down_launch(num_grouped, num_local, width, pairs, out, config)
    if launch is None:
        return out
    grid, tiles_m = launch
    _down_kernel[grid](
        act,
        act.stride(0),
        offsets if pairs is None else pairs,
        offsets,
        w2,
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        weights,
        weights.stride(0),
        weights.stride(1),
        out,
        out.stride(0),
        num_local,
        weights.size(1),
        width,
        depth,
        tiles_m,
        out.size(0),
        SORTED=pairs is not None,
        ZERO_PAD=pairs is None,
        **_launch_options(config, num_local, depth, act.dtype),
    )
    return out
