"""The fp8 block-scale expert GEMMs of the ``triton`` experts backend: torch spec and Triton.

The grouped rows, the gather through ``pairs`` and the epilogues are the bf16 kernels'
(``expert_gemm.py``); the operands are the contract's (``ep_runtime/quantization.py``):

* ``expert_up_fp8``: ``q(x)`` (e4m3 rows ``[R, H]`` and fp32 scales ``[R, H/128]``) against
  e4m3 ``w13`` with one fp32 ``scale_inv`` per 128×128 block. Each 128-deep k-step's fp32
  partial product is scaled once by its row-group scale and its weight block's scale before it
  joins the fp32 accumulator; a config's ``block_k`` of 256 runs two such steps per loop
  iteration (twice the bytes per pipeline stage, half the iterations). The epilogue applies
  the activation in fp32 and quantizes the result per row and 128 columns (BLOCK_N = 128: a
  tile is one group): it writes ``q(act) [P, I]`` e4m3 and its scales ``[P, I/128]``.
* ``expert_down_fp8``: ``q(act)`` against e4m3 ``w2`` the same way; router weight in the
  epilogue, one rounding to the output dtype; EXPANDED padding rows zero.

A config's ``tma`` loads the weights, and rows that lie contiguous (GEMM2's ``q(act)``, GEMM1's
rows in EXPANDED), through TMA descriptors built on the host; gathered rows keep pointer loads.

Deterministic (fixed order, no atomics), static grid, nothing read on the host.
"""

from __future__ import annotations

import torch

from ep_runtime.experts.gemm.expert_gemm import activation_spec, nonempty_groups
from ep_runtime.experts.gemm.expert_tile_parts import (
    activated,
    column_groups,
    column_step,
    down_launch,
    expert_tile,
    flush_down_tile,
    group_tiles,
    row_sources,
    row_targets,
    row_tiles,
    store_last_down_tile,
    untransposed,
    zero_padding_tiles,
)
from ep_runtime.experts.gemm.expert_tiles import TileConfig
from ep_runtime.kernels.fp8_quant import quantize_groups
from ep_runtime.kernels.triton_common import INTERPRET, TensorDescriptor, jit, kernel, pow2, tl
from ep_runtime.quantization import (
    BLOCK,
    dequantize_activations,
    dequantize_weight_blocks,
    quantize_activations,
)

# --------------------------------------------------------------------------- torch spec


def expert_up_fp8_spec(
    x_q: torch.Tensor,  # [R, H] e4m3
    x_s: torch.Tensor,  # [R, H/128] fp32
    w13: torch.Tensor,  # [L, 2I | I, H] e4m3
    s13: torch.Tensor,  # [L, 2I/128 | I/128, H/128] fp32
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is row p
    *,
    top_k: int,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q(act) [P, I] e4m3, scales [P, I/128] fp32)``; rows past ``offsets[L]`` zero."""
    num_grouped = x_q.size(0) if pairs is None else pairs.numel()
    width = w13.size(1) // 2 if gated else w13.size(1)
    act = torch.zeros(num_grouped, width, dtype=torch.float32, device=x_q.device)
    for expert, start, end in nonempty_groups(offsets):
        source = torch.arange(start, end, device=x_q.device)
        if pairs is not None:
            source = pairs[start:end].long() // top_k
        rows = dequantize_activations(x_q[source], x_s[source])
        h = rows @ dequantize_weight_blocks(w13[expert], s13[expert]).T
        act[start:end] = activation_spec(h, gated)
    return quantize_activations(act)


def expert_down_fp8_spec(
    a_q: torch.Tensor,  # [P, I] e4m3
    a_s: torch.Tensor,  # [P, I/128] fp32
    w2: torch.Tensor,  # [L, H, I] e4m3
    s2: torch.Tensor,  # [L, H/128, I/128] fp32
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is out row p
    weights: torch.Tensor,  # [R, K'] fp32
    *,
    num_out: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[num_out, H]`` in ``dtype``: each grouped row's weighted result at its row, else 0."""
    out = torch.zeros(num_out, w2.size(1), dtype=dtype, device=a_q.device)
    for expert, start, end in nonempty_groups(offsets):
        dest = torch.arange(start, end, device=a_q.device)
        if pairs is not None:
            dest = pairs[start:end].long()
        weight = weights.reshape(-1)[dest] if pairs is not None else weights[dest, 0]
        rows = dequantize_activations(a_q[start:end], a_s[start:end])
        y = rows @ dequantize_weight_blocks(w2[expert], s2[expert]).T
        out[dest] = (y * weight.float().unsqueeze(1)).to(dtype)
    return out


# --------------------------------------------------------------------------- Triton kernels


@jit
def _scaled_step(acc, a, b, scale, SWAP: tl.constexpr):
    """``acc += (a · b) · scale`` for one 128-deep k-step: ``a [BM, BK]`` e4m3 rows, ``b [BK,
    BN]`` e4m3 columns of one weight block, ``scale [BM]`` each row's activation scale times the
    block's weight scale (SWAP: the transposed tile ``[BN, BM]``). One fused multiply-add per
    element joins the partial product to the fp32 accumulator. Under the interpreter the
    operands go to fp32 (exact)."""
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if SWAP:
        part = tl.dot(tl.trans(b), tl.trans(a), out_dtype=tl.float32)
        acc = tl.fma(part, scale[None, :], acc)
    else:
        part = tl.dot(a, b, out_dtype=tl.float32)
        acc = tl.fma(part, scale[:, None], acc)
    return acc


@jit
def _row_step(a_rows, a_desc, a_row, a_scales, ok_m, k_step, BK: tl.constexpr, TMA: tl.constexpr):
    """One k-step of the rows: e4m3 codes ``[BM, BK]`` and their scales ``[BM]``. TMA: the codes
    of contiguous rows from ``a_row`` on through the descriptor (rows past ``ok_m`` are loaded
    too; each only meets its own output row, which is never stored), else gathered."""
    if TMA:
        a = a_desc.load([a_row, k_step * BK])
    else:
        a = tl.load(a_rows + k_step * BK, mask=ok_m[:, None], other=0.0)
    return a, tl.load(a_scales + k_step, mask=ok_m, other=0.0)


@jit
def _weight_step(w_tile, w_desc, w_row, ok_n, k_step, BK: tl.constexpr, TMA: tl.constexpr):
    """One k-step of a weight tile, e4m3 ``[BK, BN]``: through the descriptor of the ``[L·N, K]``
    weights from row ``w_row`` (loaded ``[BN, BK]``, used transposed), else from ``w_tile``
    (the tile's pointers at k = 0)."""
    if TMA:
        w = w_desc.load([w_row, k_step * BK]).T
    else:
        w = tl.load(w_tile + k_step * BK, mask=ok_n[None, :], other=0.0)
    return w


@jit
def _store_quantized_tile(
    out,
    outs,
    o_rows,
    s_rows,
    acc_g,
    acc_u,
    tile_n,
    ok_m,
    width,
    BN: tl.constexpr,
    GATED: tl.constexpr,
    SWAP: tl.constexpr,
):
    """GEMM1's epilogue of column tile ``tile_n`` (one 128-column group): the activation in
    fp32, quantized per row; codes at ``o_rows``, scales at ``s_rows``."""
    result = activated(untransposed(acc_g, SWAP), untransposed(acc_u, SWAP), GATED)
    codes, scale = quantize_groups(result, 1)  # [BM, BN] e4m3, [BM]
    n = tile_n * BN + tl.arange(0, BN)
    tl.store(o_rows + n[None, :], codes, mask=ok_m[:, None] & (n < width)[None, :])
    tl.store(s_rows + tile_n, scale, mask=ok_m & (tile_n * BN < width))


@kernel(do_not_specialize=["tiles_m"])
def _up_fp8_kernel(
    x,  # [R, H] e4m3
    x_desc,  # its TMA descriptor (TMA_A: EXPANDED rows), else None
    stride_xm,
    xs,  # [R, H/128] fp32
    stride_xsm,
    pairs,  # [P] int32 (SORTED)
    offsets,  # [L + 1] int32
    w,  # [L, 2I | I, H] e4m3
    w_desc,  # TMA descriptor of w as [L·(2I | I), H] (TMA_B), else None
    stride_we,
    stride_wn,
    ws,  # [L, 2I/128 | I/128, H/128] fp32
    stride_wse,
    stride_wsn,
    out,  # [P, I] e4m3
    stride_om,
    outs,  # [P, I/128] fp32
    stride_osm,
    num_local,
    top_k,
    width,  # I
    depth,  # H
    tiles_m,
    GATED: tl.constexpr,
    SORTED: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,  # 128: one quantization group per tile row
    BK: tl.constexpr,  # 128: one scale per k-step
    KU: tl.constexpr,  # k-steps per loop iteration (their loads share a pipeline stage)
    TILES_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    LP: tl.constexpr,
    TMA_A: tl.constexpr,
    TMA_B: tl.constexpr,
):
    """Program (row tile, TILES_N column tiles): q(x) rows (SORTED: gathered through
    ``pairs``), block scales per k-step, activation and quantization of each tile's result in
    its epilogue."""
    num_n = width // BN
    _, column_group, expert, _, row_start, row_end = expert_tile(
        tl.program_id(0), offsets, num_local, tiles_m, (num_n + TILES_N - 1) // TILES_N, BM,
        GROUP_M, LP,
    )  # fmt: skip
    if expert < num_local:
        p = row_start + tl.arange(0, BM)
        ok_m = p < row_end
        source = row_sources(pairs, p, ok_m, top_k, SORTED)
        kk = tl.arange(0, BK)
        e64 = expert.to(tl.int64)
        a_rows = x + source[:, None] * stride_xm + kk[None, :]
        a_scales = xs + source * stride_xsm
        w_expert = w + e64 * stride_we + kk[:, None]
        s_expert = ws + e64 * stride_wse
        p64 = p.to(tl.int64)
        o_rows = out + p64[:, None] * stride_om
        s_rows = outs + p64 * stride_osm
        steps = depth // (BK * KU)
        up_blocks = (width // BK) * stride_wsn  # the up half's first weight block row
        w_rows = expert * (2 * width if GATED else width)  # the expert's first row of w
        shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
        acc_g = tl.zeros(shape, dtype=tl.float32)
        acc_u = tl.zeros(shape, dtype=tl.float32)
        count = group_tiles(column_group, num_n, TILES_N)
        for i in range(0, count * steps):
            tile_n, k_outer, flush = column_step(i, steps, column_group, count, TILES_N)
            n = tile_n * BN + tl.arange(0, BN)
            ok_n = n < width
            g_tile = w_expert + n[None, :] * stride_wn
            g_row = w_rows + tile_n * BN
            g_scale = s_expert + tile_n * stride_wsn  # BN = BK: one weight block a tile
            for sub in tl.static_range(KU):
                k_step = k_outer * KU + sub
                a, a_scale = _row_step(a_rows, x_desc, row_start, a_scales, ok_m, k_step, BK, TMA_A)
                g = _weight_step(g_tile, w_desc, g_row, ok_n, k_step, BK, TMA_B)
                g_step = a_scale * tl.load(g_scale + k_step)
                acc_g = _scaled_step(acc_g, a, g, g_step, SWAP)
                if GATED:
                    u_tile = g_tile + width * stride_wn
                    u = _weight_step(u_tile, w_desc, g_row + width, ok_n, k_step, BK, TMA_B)
                    u_step = a_scale * tl.load(g_scale + up_blocks + k_step)
                    acc_u = _scaled_step(acc_u, a, u, u_step, SWAP)
            if TILES_N > 1:  # noqa: SIM102 (a constexpr branch: one tile compiles without it)
                if flush:
                    _store_quantized_tile(
                        out, outs, o_rows, s_rows, acc_g, acc_u, tile_n, ok_m, width, BN,
                        GATED, SWAP,
                    )  # fmt: skip
                    acc_g = tl.zeros(shape, dtype=tl.float32)
                    acc_u = tl.zeros(shape, dtype=tl.float32)
        last = column_group * TILES_N + count - 1
        _store_quantized_tile(
            out, outs, o_rows, s_rows, acc_g, acc_u, last, ok_m, width, BN, GATED, SWAP
        )


@kernel(do_not_specialize=["tiles_m", "num_rows"])
def _down_fp8_kernel(
    act,  # [P, I] e4m3
    a_desc,  # its TMA descriptor (TMA_A), else None
    stride_am,
    acts,  # [P, I/128] fp32
    stride_asm,
    pairs,  # [P] int32 (SORTED)
    offsets,  # [L + 1] int32
    w,  # [L, H, I] e4m3
    w_desc,  # TMA descriptor of w as [L·H, I] (TMA_B), else None
    stride_we,
    stride_wn,
    ws,  # [L, H/128, I/128] fp32
    stride_wse,
    stride_wsn,
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
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,  # 128
    KU: tl.constexpr,  # k-steps per loop iteration
    TILES_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    LP: tl.constexpr,
    TMA_A: tl.constexpr,
    TMA_B: tl.constexpr,
):
    """Program (row tile, TILES_N column tiles): block scales per k-step, router weight and one
    rounding in each tile's epilogue; spare programs zero EXPANDED padding (as the bf16 kernel)."""
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
        e64 = expert.to(tl.int64)
        p64 = p.to(tl.int64)
        a_rows = act + p64[:, None] * stride_am + kk[None, :]
        a_scales = acts + p64 * stride_asm
        w_expert = w + e64 * stride_we + kk[:, None]
        s_expert = ws + e64 * stride_wse
        steps = depth // (BK * KU)
        shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
        acc = tl.zeros(shape, dtype=tl.float32)
        count = group_tiles(column_group, num_n, TILES_N)
        for i in range(0, count * steps):
            tile_n, k_outer, flush = column_step(i, steps, column_group, count, TILES_N)
            n = tile_n * BN + tl.arange(0, BN)
            ok_n = n < width
            b_tile = w_expert + n[None, :] * stride_wn
            b_row = expert * width + tile_n * BN
            b_scale = s_expert + (tile_n * BN // BK) * stride_wsn  # BN | BK: one block a tile
            for sub in tl.static_range(KU):
                k_step = k_outer * KU + sub
                a, a_scale = _row_step(a_rows, a_desc, row_start, a_scales, ok_m, k_step, BK, TMA_A)
                b = _weight_step(b_tile, w_desc, b_row, ok_n, k_step, BK, TMA_B)
                acc = _scaled_step(acc, a, b, a_scale * tl.load(b_scale + k_step), SWAP)
            acc = flush_down_tile(acc, flush, out, o_rows, weight, n, ok_m, ok_n, SWAP, TILES_N)
        last_tile = column_group * TILES_N + count - 1
        store_last_down_tile(out, o_rows, acc, weight, last_tile, width, ok_m, BN, SWAP)
    elif ZERO_PAD:
        zero_padding_tiles(
            out, stride_om, offsets, num_local, tile_m, first_tile, num_rows, column_group,
            width, BM, BN, TILES_N,
        )  # fmt: skip


# --------------------------------------------------------------------------- launchers


def _descriptor(codes: torch.Tensor, block_rows: int) -> TensorDescriptor | None:
    """TMA descriptor of the 2-D e4m3 ``codes`` in boxes of ``block_rows`` × 128, or None where
    TMA cannot read them: no rows, columns not contiguous, rows that overlap, or a base or row
    stride off 16 bytes (those load through pointers)."""
    rows, cols = codes.shape
    row_stride = codes.stride(0)
    if rows == 0 or codes.stride(1) != 1 or row_stride < cols or row_stride % 16:
        return None
    if codes.data_ptr() % 16:
        return None
    return TensorDescriptor(codes, [rows, cols], [row_stride, 1], [block_rows, BLOCK])


def _tma_options(
    config: TileConfig, rows: torch.Tensor | None, weights: torch.Tensor
) -> tuple[TensorDescriptor | None, TensorDescriptor | None, dict]:
    """``(rows' descriptor, weights' descriptor, their constexprs)``: with ``config.tma`` the
    contiguous weights ``[L, N, K]`` (as ``[L·N, K]``) and ``rows`` (contiguous rows, or None
    where they are gathered) load through the Tensor Memory Accelerator wherever it can read
    them; the rest through pointers."""
    if not config.tma:
        return None, None, {"TMA_A": False, "TMA_B": False}
    a_desc = None if rows is None else _descriptor(rows, config.block_m)
    w_desc = None
    if weights.is_contiguous():
        w_desc = _descriptor(weights.view(-1, weights.size(2)), config.block_n)
    return a_desc, w_desc, {"TMA_A": a_desc is not None, "TMA_B": w_desc is not None}


def _options(config: TileConfig, num_local: int, depth: int) -> dict:
    """Launch options; a ``block_k`` of several 128-deep blocks (one scale each) is that many
    k-steps per loop iteration where it divides ``depth``, else one."""
    assert config.block_k % BLOCK == 0, "fp8 block scales need BLOCK_K a multiple of 128"
    assert BLOCK % config.block_n == 0, "a column tile lies in one weight block: BLOCK_N | 128"
    return {
        "SWAP": config.swap,
        "BM": config.block_m,
        "BN": config.block_n,
        "BK": BLOCK,
        "KU": config.block_k // BLOCK if depth % config.block_k == 0 else 1,
        "TILES_N": config.tiles_n,
        "GROUP_M": config.group_m,
        "LP": pow2(num_local),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def expert_up_fp8(
    x_q: torch.Tensor,  # [R, H] e4m3 (rows may be strided, columns contiguous)
    x_s: torch.Tensor,  # [R, H/128] fp32 (columns contiguous)
    w13: torch.Tensor,  # [L, 2I | I, H] e4m3, contiguous
    s13: torch.Tensor,  # [L, 2I/128 | I/128, H/128] fp32, contiguous
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is x[p]
    out_q: torch.Tensor,  # [P, I] e4m3, written for rows < offsets[L]
    out_s: torch.Tensor,  # [P, I/128] fp32, likewise
    *,
    top_k: int,
    gated: bool,
    config: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_grouped, width = out_q.shape
    num_local, _, depth = w13.shape
    assert config.block_n == BLOCK, "GEMM1 quantizes its result per tile: BLOCK_N = 128"
    if num_grouped == 0 or width == 0:
        return out_q, out_s
    tiles_m = row_tiles(num_grouped, num_local, config.block_m)
    grid = (tiles_m * column_groups(width, config),)
    x_desc, w_desc, tma = _tma_options(config, x_q if pairs is None else None, w13)
    _up_fp8_kernel[grid](
        x_q, x_desc, x_q.stride(0), x_s, x_s.stride(0), offsets if pairs is None else pairs,
        offsets, w13, w_desc, w13.stride(0), w13.stride(1), s13, s13.stride(0), s13.stride(1),
        out_q, out_q.stride(0), out_s, out_s.stride(0), num_local, top_k, width, depth, tiles_m,
        GATED=gated, SORTED=pairs is not None, **_options(config, num_local, depth), **tma,
    )  # fmt: skip
    return out_q, out_s


def expert_down_fp8(
    a_q: torch.Tensor,  # [P, I] e4m3
    a_s: torch.Tensor,  # [P, I/128] fp32
    w2: torch.Tensor,  # [L, H, I] e4m3, contiguous
    s2: torch.Tensor,  # [L, H/128, I/128] fp32, contiguous
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is out row p
    weights: torch.Tensor,  # [R, K'] fp32 router weights (a strided view is fine)
    out: torch.Tensor,  # [R·K, H] (pairs) or [R, H] (every row written: padding zero)
    *,
    config: TileConfig,
) -> torch.Tensor:
    num_grouped, depth = a_q.shape
    num_local, width, _ = w2.shape
    launch = down_launch(num_grouped, num_local, width, pairs, out, config)
    if launch is None:
        return out
    grid, tiles_m = launch
    a_desc, w_desc, tma = _tma_options(config, a_q, w2)
    _down_fp8_kernel[grid](
        a_q, a_desc, a_q.stride(0), a_s, a_s.stride(0), offsets if pairs is None else pairs,
        offsets, w2, w_desc, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
        weights, weights.stride(0), weights.stride(1), out, out.stride(0), num_local,
        weights.size(1), width, depth, tiles_m, out.size(0), SORTED=pairs is not None,
        ZERO_PAD=pairs is None, **_options(config, num_local, depth), **tma,
    )  # fmt: skip
    return out
