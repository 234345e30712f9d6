"""The expert GEMMs of the ``triton`` experts backend: their torch spec and their Triton kernels.

Both GEMMs walk grouped rows: rows ``[offsets[e], offsets[e+1])`` belong to local expert ``e``;
rows past ``offsets[L]`` are padding and are never read. A grouped row ``p`` is either a row of
the input itself (EXPANDED: the dispatcher grouped them) or, through ``pairs[p] = row·K + slot``
(STANDARD: ``expert_rows.py`` sorted the served (row, slot) pairs by expert), a pair whose
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
exact, since bf16 → fp32 is). The building blocks the fp8 GEMMs share with these (tile and row
bookkeeping, the loop's steps, epilogues, grid bounds): ``expert_tile_parts.py``.
"""

from __future__ import annotations

import itertools

import torch

from ep_runtime.experts.gemm.expert_tile_parts import (
    column_groups,
    column_step,
    down_launch,
    expert_tile,
    flush_down_tile,
    group_tiles,
    row_sources,
    row_targets,
    row_tiles,
    step_masks,
    store_last_down_tile,
    store_up_tile,
    tile_step,
    zero_padding_tiles,
)
from ep_runtime.experts.gemm.expert_tiles import TileConfig
from ep_runtime.kernels.triton_common import kernel, pow2, tl

# --------------------------------------------------------------------------- torch spec


def activation_spec(h: torch.Tensor, gated: bool) -> torch.Tensor:
    """fp32 ``silu(gate)·up`` (``h = [gate | up]``) or ``relu(h)²``."""
    if gated:
        half = h.size(1) // 2
        return torch.nn.functional.silu(h[:, :half]) * h[:, half:]
    return torch.relu(h).square()


def nonempty_groups(offsets: torch.Tensor | list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every non-empty group (a tensor is read on the host)."""
    bounds = offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets
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
    for expert, start, end in nonempty_groups(offsets):
        source = torch.arange(start, end, device=x.device)
        if pairs is not None:
            source = pairs[start:end].long() // top_k
        h = x[source].float() @ w13[expert].float().T
        out[start:end] = activation_spec(h, gated).to(x.dtype)
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
    for expert, start, end in nonempty_groups(offsets):
        dest = torch.arange(start, end, device=act.device)
        if pairs is not None:
            dest = pairs[start:end].long()
        weight = weights.reshape(-1)[dest] if pairs is not None else weights[dest, 0]
        y = act[start:end].float() @ w2[expert].float().T
        out[dest] = (y * weight.float().unsqueeze(1)).to(act.dtype)
    return out


# --------------------------------------------------------------------------- Triton kernels


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
    _, column_group, expert, _, row_start, row_end = expert_tile(
        tl.program_id(0), offsets, num_local, tiles_m, (num_n + TILES_N - 1) // TILES_N, BM,
        GROUP_M, LP,
    )  # fmt: skip
    if expert < num_local:
        p = row_start + tl.arange(0, BM)
        ok_m = p < row_end
        source = row_sources(pairs, p, ok_m, top_k, SORTED)
        kk = tl.arange(0, BK)
        a_rows = x + source[:, None] * stride_xm + kk[None, :] * stride_xk
        w_expert = w + expert.to(tl.int64) * stride_we + kk[:, None] * stride_wk
        o_rows = out + p.to(tl.int64)[:, None] * stride_om
        steps = (depth + BK - 1) // BK
        shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
        acc_g = tl.zeros(shape, dtype=tl.float32)
        acc_u = tl.zeros(shape, dtype=tl.float32)
        count = group_tiles(column_group, num_n, TILES_N)
        for i in range(0, count * steps):
            tile_n, k_step, flush = column_step(i, steps, column_group, count, TILES_N)
            n = tile_n * BN + tl.arange(0, BN)
            ok_n = n < width
            a_ok, w_ok = step_masks(ok_m, ok_n, kk, depth - k_step * BK, EVEN_K)
            a = tl.load(a_rows + k_step * BK * stride_xk, mask=a_ok, other=0.0)
            g_ptrs = w_expert + n[None, :] * stride_wn + k_step * BK * stride_wk
            acc_g = tile_step(acc_g, a, tl.load(g_ptrs, mask=w_ok, other=0.0), SWAP, PRECISION)
            if GATED:
                u = tl.load(g_ptrs + width * stride_wn, mask=w_ok, other=0.0)
                acc_u = tile_step(acc_u, a, u, SWAP, PRECISION)
            if TILES_N > 1:  # noqa: SIM102 (a constexpr branch: one tile compiles without it)
                if flush:
                    store_up_tile(out, o_rows, acc_g, acc_u, n, ok_m, ok_n, GATED, SWAP)
                    acc_g = tl.zeros(shape, dtype=tl.float32)
                    acc_u = tl.zeros(shape, dtype=tl.float32)
        n = (column_group * TILES_N + count - 1) * BN + tl.arange(0, BN)
        store_up_tile(out, o_rows, acc_g, acc_u, n, ok_m, n < width, GATED, SWAP)


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
    tile_m, column_group, expert, first_tile, row_start, row_end = expert_tile(
        tl.program_id(0), offsets, num_local, tiles_m, (num_n + TILES_N - 1) // TILES_N, BM,
        GROUP_M, LP,
    )  # fmt: skip
    if expert < num_local:
        p = row_start + tl.arange(0, BM)
        ok_m = p < row_end
        dest, weight = row_targets(pairs, p, ok_m, top_k, weights, stride_rr, stride_rk, SORTED)
        o_rows = out + dest[:, None] * stride_om
        kk = tl.arange(0, BK)
        a_rows = act + p.to(tl.int64)[:, None] * stride_am + kk[None, :]
        w_expert = w + expert.to(tl.int64) * stride_we + kk[:, None] * stride_wk
        steps = (depth + BK - 1) // BK
        shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
        acc = tl.zeros(shape, dtype=tl.float32)
        count = group_tiles(column_group, num_n, TILES_N)
        for i in range(0, count * steps):
            tile_n, k_step, flush = column_step(i, steps, column_group, count, TILES_N)
            n = tile_n * BN + tl.arange(0, BN)
            ok_n = n < width
            a_ok, w_ok = step_masks(ok_m, ok_n, kk, depth - k_step * BK, EVEN_K)
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


def _launch_options(config: TileConfig, num_local: int, depth: int, dtype: torch.dtype) -> dict:
    assert not config.tma, "TileConfig.tma is an option of the fp8 GEMMs"
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
