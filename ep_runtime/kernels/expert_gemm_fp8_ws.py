"""Hopper (SM90) warp-specialized fp8 block-scale expert GEMMs, in Gluon.

The same contract as ``kernels/expert_gemm_fp8.py`` (whose torch specs, ``expert_up_fp8_spec``
and ``expert_down_fp8_spec``, are these kernels' twins): e4m3 rows times e4m3 weights with one
fp32 scale per row and 128 columns and one per 128×128 weight block; each 128-deep k-step's
partial product is scaled and added to an fp32 accumulator (the promotion).

Why a second kernel: in the Triton kernels every warp waits for every other at each k-step, so
the tensor cores idle while the promotion runs on the CUDA cores (0.5 of GEMM1's 2.4 ms at the
DeepSeek-V3 shard's prefill). Here a program holds three warpgroups that share a ring of
shared-memory stages through mbarriers and never wait for each other otherwise:

* a loader (4 warps, few registers): the weights' two 128-row tiles of each k-step through TMA;
  the rows through TMA where they lie contiguous, else gathered with ``cp.async`` (STANDARD's
  GEMM1 reads each pair's row of ``q(x)``);
* two consumers (4 warps each, 64 rows of the 128-row tile): per k-step two asynchronous
  ``wgmma`` (m64 n128 k32 ×4), each promoted into its fp32 accumulator as soon as it is done.
  While one consumer promotes, the other's MMAs run: the two alternate on the tensor cores.

A program computes 128 rows × two 128-column weight tiles: GEMM1 the gate and the up tile of
one 128-column group (SiLU and the per-row quantization of that group in its epilogue), GEMM2
256 output columns (router weight and one rounding in its epilogue). Gated GEMM1 only; H and I
multiples of 128. The grid, tile order and spare programs (EXPANDED padding rows zeroed by
GEMM2) are the Triton kernels'. Compiled only for SM90 (no interpreter: the Triton kernels
carry the CPU checks of the same contract; these are tested on the GPU against the specs).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ep_runtime.kernels.expert_tile_parts import row_tiles
from ep_runtime.kernels.expert_tiles import TileConfig
from ep_runtime.kernels.triton_common import cdiv, pow2
from ep_runtime.quantization import BLOCK

TILE_M = gl.constexpr(128)  # rows of a program: two consumer warpgroups of WG_ROWS
WG_ROWS = gl.constexpr(64)  # rows of one consumer's wgmma
WARPS = gl.constexpr(4)  # per partition (a warpgroup)
LOADER_REGS = gl.constexpr(40)  # registers per thread of the loader; the consumers get the rest
KERNEL_REGS = 168  # 65536 registers over three warpgroups (rounded down to 8)
CONSUMER_REGS = gl.constexpr(232)
# GEMM1 on rows neither TMA nor 16-byte cp.async can read: the Triton kernel's prefill tile
TRITON_FALLBACK = TileConfig(
    128, 128, 128, group_m=8, num_warps=8, num_stages=3
)  # and 3 · 168 − 40 − 232 = 232 to the default partition


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _larger(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _turns():
    """The two consumers' turn mbarriers (one arrival a phase: the other's MMA issue)."""
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    return turns


@gluon.jit
def _program_tile(
    offsets,  # [L + 1] int32
    num_local,
    tiles_m,
    num_n,
    num_rows,  # rows spare programs zero below (ZERO_PAD), else unused
    BM: gl.constexpr,
    GROUP_M: gl.constexpr,
    LP: gl.constexpr,
    ZERO_PAD: gl.constexpr,
):
    """Program → (column tile, expert, first row, end row, whether it is a real tile): the
    Triton kernels' ``expert_tile`` order (row tiles expert by expert, GROUP_M row tiles
    sharing column tiles). A spare program past the real tiles covers EXPANDED padding rows
    from ``offsets[L]`` on (ZERO_PAD), else no row."""
    pid = gl.program_id(0)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % in_group) % size_m
    tile_n = (pid % in_group) // size_m
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    e = gl.arange(0, LP, layout)
    present = e < num_local
    starts = gl.load(offsets + e, mask=present, other=0)
    ends = gl.load(offsets + e + 1, mask=present, other=0)
    tiles = gl.where(present, (ends - starts + BM - 1) // BM, 0)
    expert = gl.reduce((gl.associative_scan(tiles, 0, _add) <= tile_m).to(gl.int32), 0, _add)
    first_tile = gl.reduce(gl.where(e < expert, tiles, 0), 0, _add)
    real = expert < num_local
    row_start = gl.load(offsets + gl.minimum(expert, num_local)) + (tile_m - first_tile) * BM
    row_end = gl.load(offsets + gl.minimum(expert + 1, num_local))
    if not real:  # a spare program: EXPANDED padding rows from offsets[L] on, else none
        if ZERO_PAD:  # noqa: SIM108 (a constexpr branch)
            row_end = num_rows
        else:
            row_end = row_start
    return tile_n, gl.minimum(expert, num_local - 1), row_start, row_end, real


@gluon.jit
def _loader(
    a_desc,  # TMA descriptor of contiguous rows [*, K] in boxes [TILE_M, 128], or None (gather)
    x,  # [R, K] e4m3 rows to gather (GATHER)
    stride_xm,
    pairs,  # [P] int32 (SORTED): grouped row p reads row pairs[p] // top_k, else row p
    top_k,
    w_desc,  # TMA descriptor of the weights [L·N, K] in boxes [128, 128]
    b0_row,  # first weight row of each tile in w_desc's [L·N, K]
    b1_row,
    ring,
    tile,
    GATHER: gl.constexpr,
    SORTED: gl.constexpr,
    S: gl.constexpr,
):
    """Fills stage ``k % S`` for k-step ``k`` once both consumers released it. ``ring``: the
    stages ``a_bufs [S, TILE_M, 128]``, ``b0_bufs``/``b1_bufs [S, 128, 128]`` (e4m3) and their
    mbarriers ``ready`` (operands landed) and ``empty`` (both consumers done); ``tile``: the
    program's rows ``[row_start, row_end)``, column tile and k-steps."""
    a_bufs, b0_bufs, b1_bufs, ready, empty, _ = ring
    row_start, row_end, _, steps = tile
    w_bytes: gl.constexpr = 2 * 128 * 128
    if GATHER:
        # 16 bytes a thread: 8 threads span a 128-byte row, a warp 4 rows, 4 warps 16 rows
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
        p = row_start + gl.arange(0, TILE_M, gl.SliceLayout(1, layout))
        ok = p < row_end
        if SORTED:  # noqa: SIM108 (a constexpr branch: pairs is read only when sorted)
            source = gl.load(pairs + p, mask=ok, other=0) // top_k
        else:
            source = p
        columns = gl.arange(0, 128, gl.SliceLayout(0, layout))
        rows = x + source.to(gl.int64)[:, None] * stride_xm + columns[None, :]
        mask = ok[:, None] & (columns < 128)[None, :]
    for k in range(steps):
        stage = k % S
        mbarrier.wait(empty.index(stage), ((k // S) & 1) ^ 1)
        bar = ready.index(stage)
        if GATHER:
            async_copy.async_copy_global_to_shared(a_bufs.index(stage), rows + k * 128, mask=mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            mbarrier.expect(bar, w_bytes)
        else:
            mbarrier.expect(bar, w_bytes + TILE_M * 128)
            tma.async_copy_global_to_shared(a_desc, [row_start, k * 128], bar, a_bufs.index(stage))
        tma.async_copy_global_to_shared(w_desc, [b0_row, k * 128], bar, b0_bufs.index(stage))
        tma.async_copy_global_to_shared(w_desc, [b1_row, k * 128], bar, b1_bufs.index(stage))


@gluon.jit
def _promoted(acc, part, scale):
    """``acc + part · scale`` (one fused multiply-add per element; ``scale [WG_ROWS]``)."""
    return gl.fma(part, gl.expand_dims(scale, 1), acc)


@gluon.jit
def _mma_in_turn(a, b, part, turns, i, WG: gl.constexpr):
    """The consumer's ``i``-th MMA (``a · bᵀ``, fp32, a fresh accumulator), issued only after
    the other consumer issued its ``i - 1``-th (consumer 0) or ``i``-th (consumer 1): the two
    alternate on the tensor cores, so each one's promotion runs while the other's MMA does
    (``turns[w]`` counts the issues consumer ``w`` waits for)."""
    mbarrier.wait(turns.index(WG), (i + WG + 1) & 1, pred=i + WG > 0)
    part = warpgroup_mma(a, b.permute((1, 0)), part, use_acc=False, is_async=True)
    mbarrier.arrive(turns.index(1 - WG), count=1)
    return warpgroup_mma_wait(0, deps=(part,))


@gluon.jit
def _mainloop(
    ring,
    a_scales,  # [WG_ROWS] pointers to each row's k-step scales
    ok,  # [WG_ROWS] rows inside the tile
    b0_scales,  # pointer to tile 0's weight-block scales over k
    b1_scales,
    has_b1,  # whether tile 1 lies inside the weights (its scales are read)
    steps,
    WG: gl.constexpr,
    GATHER: gl.constexpr,
    S: gl.constexpr,
):
    """One consumer's k loop: ``(acc0, acc1)`` fp32 ``[WG_ROWS, 128]`` of its rows against the
    two weight tiles, each 128-deep step promoted with its row and block scales."""
    a_bufs, b0_bufs, b1_bufs, ready, empty, turns = ring
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 128, 32]
    )
    acc0 = gl.zeros([WG_ROWS, 128], gl.float32, mma)
    acc1 = gl.zeros([WG_ROWS, 128], gl.float32, mma)
    # the MMAs' result, threaded through the loop as their (ignored: use_acc=False) operand so
    # every MMA writes the same registers, dead once promoted (a fresh operand or an
    # accumulator there would cost copies or spills)
    part = gl.zeros([WG_ROWS, 128], gl.float32, mma)
    live = steps > 0
    row_scale = gl.load(a_scales, mask=ok & live, other=0.0)
    scale0 = gl.load(b0_scales, mask=live, other=0.0)
    scale1 = gl.load(b1_scales, mask=live & has_b1, other=0.0)
    for k in range(steps):
        stage = k % S
        mbarrier.wait(ready.index(stage), (k // S) & 1)
        if GATHER:
            fence_async_shared()  # cp.async wrote the rows: order them before the async proxy
        more = k + 1 < steps  # the next step's scales load while this step's MMAs run (after
        # the fence, which would otherwise wait for them)
        next_row_scale = gl.load(a_scales + k + 1, mask=ok & more, other=0.0)
        next_scale0 = gl.load(b0_scales + k + 1, mask=more, other=0.0)
        next_scale1 = gl.load(b1_scales + k + 1, mask=more & has_b1, other=0.0)
        a = a_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS)
        part = _mma_in_turn(a, b0_bufs.index(stage), part, turns, 2 * k, WG)
        acc0 = _promoted(acc0, part, row_scale * scale0)
        part = _mma_in_turn(a, b1_bufs.index(stage), part, turns, 2 * k + 1, WG)
        mbarrier.arrive(empty.index(stage), count=1)
        acc1 = _promoted(acc1, part, row_scale * scale1)
        row_scale = next_row_scale
        scale0 = next_scale0
        scale1 = next_scale1
    return acc0, acc1


@gluon.jit
def _up_consumer(
    ring,
    tile,
    rows,  # (xs, stride_xsm, pairs, top_k): the rows' scales and their sources
    scales,  # (ws, gate block row, up block row): the weight scales of the two tiles
    output,  # (out, stride_om, outs, stride_osm): q(act) and its scales
    WG: gl.constexpr,
    SORTED: gl.constexpr,
    S: gl.constexpr,
):
    """GEMM1 consumer: its 64 rows against the gate and the up tile, then ``silu(g)·u`` in fp32
    quantized per row (the tile is one 128-column group): codes and scales stored."""
    row_start, row_end, tile_n, steps = tile
    xs, stride_xsm, pairs, top_k = rows
    ws, gate_scales, up_scales = scales
    out, stride_om, outs, stride_osm = output
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 128, 32]
    )
    p = row_start + WG * WG_ROWS + gl.arange(0, WG_ROWS, gl.SliceLayout(1, mma))
    ok = p < row_end
    if SORTED:  # noqa: SIM108 (a constexpr branch: pairs is read only when sorted)
        source = gl.load(pairs + p, mask=ok, other=0) // top_k
    else:
        source = p
    a_scales = xs + source.to(gl.int64) * stride_xsm
    gate, up = _mainloop(
        ring, a_scales, ok, ws + gate_scales, ws + up_scales, True, steps, WG, SORTED, S
    )
    act = gate / (1.0 + gl.exp(-gate)) * up  # the MUFU exp: libdevice's costs the loop spills
    # the contract's quantizer with full-range (2 ulp) divisions instead of correctly rounded
    # ones: div.rn's slow path is a called subroutine, and calls cost the loop its registers
    # (spills); a quotient an ulp off moves a code to its e4m3 neighbour at most, as the
    # accumulation order already may
    floor = gl.maximum(gl.reduce(gl.abs(act), 1, _larger), 1e-10)
    scale = gl.fdiv(floor, 448.0)
    inverse = gl.expand_dims(gl.fdiv(448.0, floor), 1)
    codes = gl.minimum(gl.maximum(act * inverse, -448.0), 448.0).to(gl.float8e4nv)
    n = tile_n * 128 + gl.arange(0, 128, gl.SliceLayout(0, mma))
    p64 = p.to(gl.int64)
    gl.store(out + p64[:, None] * stride_om + n[None, :], codes, mask=ok[:, None])
    gl.store(outs + p64 * stride_osm + tile_n, scale, mask=ok)


@gluon.jit
def _up_ws_kernel(
    x_desc,  # TMA descriptor of q(x) rows (EXPANDED), else None
    x, stride_xm, xs, stride_xsm,
    pairs, offsets,
    w_desc,  # TMA descriptor of w13 as [L·2I, H]
    ws, stride_wse, stride_wsn,
    out, stride_om, outs, stride_osm,
    num_local, top_k, width, depth, tiles_m,
    SORTED: gl.constexpr, S: gl.constexpr, GROUP_M: gl.constexpr, LP: gl.constexpr,
):  # fmt: skip
    """Program (128 rows, one 128-column group of I): ``q(act)`` and its scales. SORTED: the
    rows gathered through ``cp.async``, else loaded through TMA."""
    tile_n, expert, row_start, row_end, real = _program_tile(
        offsets, num_local, tiles_m, width // 128, 0, TILE_M, GROUP_M, LP, False
    )
    steps = gl.where(real, depth // 128, 0)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [S, TILE_M, 128], w_desc.layout)
    b0_bufs = gl.allocate_shared_memory(gl.float8e4nv, [S, 128, 128], w_desc.layout)
    b1_bufs = gl.allocate_shared_memory(gl.float8e4nv, [S, 128, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1 + (32 * WARPS if SORTED else 0))
        mbarrier.init(empty.index(i), count=2)
    gate_row = expert * 2 * width + tile_n * 128
    scales = expert.to(gl.int64) * stride_wse + tile_n * stride_wsn
    up_scales = scales + (width // 128) * stride_wsn
    ring = (a_bufs, b0_bufs, b1_bufs, ready, empty, _turns())
    tile = (row_start, row_end, tile_n, steps)
    rows = (xs, stride_xsm, pairs, top_k)
    block_rows = (ws, scales, up_scales)
    output = (out, stride_om, outs, stride_osm)
    gl.warp_specialize(
        [
            (_up_consumer, (ring, tile, rows, block_rows, output, 0, SORTED, S)),
            (_up_consumer, (ring, tile, rows, block_rows, output, 1, SORTED, S)),
            (
                _loader,
                (
                    x_desc,
                    x,
                    stride_xm,
                    pairs,
                    top_k,
                    w_desc,
                    gate_row,
                    gate_row + width,
                    ring,
                    tile,
                    SORTED,
                    SORTED,
                    S,
                ),
            ),
        ],
        [WARPS, WARPS],
        [CONSUMER_REGS, LOADER_REGS],
    )


@gluon.jit
def _down_consumer(
    ring,
    tile,
    rows,  # (acts, stride_asm, pairs, top_k): the rows' scales and their targets
    scales,  # (ws, tile 0's block row, tile 1's, whether tile 1 lies inside the weights)
    router,  # (weights, stride_rr, stride_rk)
    output,  # (out, stride_om, width)
    WG: gl.constexpr,
    SORTED: gl.constexpr,
    S: gl.constexpr,
):
    """GEMM2 consumer: its 64 rows against two 128-column tiles of w2, router weight and one
    rounding, stored at each row's target (the pair's row, or the row itself)."""
    row_start, row_end, tile_n, steps = tile
    acts, stride_asm, pairs, top_k = rows
    ws, scales0, scales1, has_b1 = scales
    weights, stride_rr, stride_rk = router
    out, stride_om, width = output
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 128, 32]
    )
    p = row_start + WG * WG_ROWS + gl.arange(0, WG_ROWS, gl.SliceLayout(1, mma))
    ok = p < row_end
    if SORTED:
        dest = gl.load(pairs + p, mask=ok, other=0)
        row = dest // top_k
        slot = dest % top_k
    else:
        dest = p
        row = p
        slot = 0
    weight = gl.load(weights + row * stride_rr + slot * stride_rk, mask=ok & (steps > 0), other=0.0)
    a_scales = acts + p.to(gl.int64) * stride_asm
    acc0, acc1 = _mainloop(
        ring, a_scales, ok, ws + scales0, ws + scales1, has_b1, steps, WG, False, S
    )
    n = tile_n * 256 + gl.arange(0, 128, gl.SliceLayout(0, mma))
    rows = out + dest.to(gl.int64)[:, None] * stride_om
    dtype: gl.constexpr = out.dtype.element_ty
    w = gl.expand_dims(weight, 1)
    gl.store(rows + n[None, :], (acc0 * w).to(dtype), mask=ok[:, None] & (n < width)[None, :])
    n = n + 128
    gl.store(rows + n[None, :], (acc1 * w).to(dtype), mask=ok[:, None] & (n < width)[None, :])


@gluon.jit
def _down_ws_kernel(
    a_desc,  # TMA descriptor of q(act) [P, I]
    acts, stride_asm,
    pairs, offsets,
    w_desc,  # TMA descriptor of w2 as [L·H, I]
    ws, stride_wse, stride_wsn,
    weights, stride_rr, stride_rk,
    out, stride_om,
    num_local, top_k, width, depth, tiles_m, num_rows,
    SORTED: gl.constexpr, ZERO_PAD: gl.constexpr, S: gl.constexpr, GROUP_M: gl.constexpr,
    LP: gl.constexpr,
):  # fmt: skip
    """Program (128 rows, 256 columns of H): the weighted result rows; spare programs zero
    EXPANDED padding rows (no k-steps, weight 0)."""
    num_n = (width + 255) // 256
    tile_n, expert, row_start, row_end, real = _program_tile(
        offsets, num_local, tiles_m, num_n, num_rows, TILE_M, GROUP_M, LP, ZERO_PAD
    )
    steps = gl.where(real, depth // 128, 0)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [S, TILE_M, 128], a_desc.layout)
    b0_bufs = gl.allocate_shared_memory(gl.float8e4nv, [S, 128, 128], w_desc.layout)
    b1_bufs = gl.allocate_shared_memory(gl.float8e4nv, [S, 128, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    b0_row = expert * width + tile_n * 256
    scales0 = expert.to(gl.int64) * stride_wse + (tile_n * 2) * stride_wsn
    ring = (a_bufs, b0_bufs, b1_bufs, ready, empty, _turns())
    tile = (row_start, row_end, tile_n, steps)
    rows = (acts, stride_asm, pairs, top_k)
    block_rows = (ws, scales0, scales0 + stride_wsn, tile_n * 256 + 128 < width)
    router = (weights, stride_rr, stride_rk)
    output = (out, stride_om, width)
    gl.warp_specialize(
        [
            (_down_consumer, (ring, tile, rows, block_rows, router, output, 0, SORTED, S)),
            (_down_consumer, (ring, tile, rows, block_rows, router, output, 1, SORTED, S)),
            (
                _loader,
                (
                    a_desc,
                    acts,
                    0,
                    pairs,
                    top_k,
                    w_desc,
                    b0_row,
                    b0_row + 128,
                    ring,
                    tile,
                    False,
                    False,
                    S,
                ),
            ),
        ],
        [WARPS, WARPS],
        [CONSUMER_REGS, LOADER_REGS],
    )


# --------------------------------------------------------------------------- launchers


def _e4m3_descriptor(codes: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor of 2-D e4m3 ``codes`` (columns contiguous, rows 16-byte aligned) in boxes
    of ``block_rows`` × 128, 128-byte swizzled (the wgmma operand layout)."""
    block = [block_rows, BLOCK]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor(codes, list(codes.shape), list(codes.stride()), block, layout)


def tma_readable(codes: torch.Tensor) -> bool:
    """Whether TMA (contiguous rows) and 16-byte ``cp.async`` (gathered rows) can read ``codes``
    (2-D e4m3 rows): row base and stride multiples of 16 bytes."""
    rows, cols = codes.shape
    return (
        rows > 0
        and codes.stride(1) == 1
        and codes.stride(0) >= cols
        and codes.stride(0) % 16 == 0
        and codes.data_ptr() % 16 == 0
    )


def _launch_options(num_local: int, config: TileConfig, block_n: int) -> dict:
    """Launch options of a ``warp_specialized`` config (its tile is fixed: 128 rows, ``block_n``
    columns, 128-deep steps)."""
    fixed = (config.block_m, config.block_n, config.block_k, config.num_warps)
    assert config.warp_specialized and fixed == (TILE_M.value, block_n, BLOCK, WARPS.value), config
    return {
        "S": config.num_stages,
        "GROUP_M": config.group_m,
        "LP": pow2(num_local),
        "num_warps": WARPS.value,
        "maxnreg": KERNEL_REGS,
    }


def expert_up_fp8_ws(
    x_q: torch.Tensor,  # [R, H] e4m3
    x_s: torch.Tensor,  # [R, H/128] fp32
    w13: torch.Tensor,  # [L, 2I, H] e4m3, contiguous (gated)
    s13: torch.Tensor,  # [L, 2I/128, H/128] fp32, contiguous
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is x[p]
    out_q: torch.Tensor,  # [P, I] e4m3
    out_s: torch.Tensor,  # [P, I/128] fp32
    *,
    top_k: int,
    config: TileConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_up_fp8`` (gated) on the warp-specialized kernel."""
    num_grouped, width = out_q.shape
    num_local, _, depth = w13.shape
    if num_grouped == 0 or width == 0:
        return out_q, out_s
    tiles_m = row_tiles(num_grouped, num_local, TILE_M.value)
    w_desc = _e4m3_descriptor(w13.view(-1, depth), 128)
    assert tma_readable(x_q), "rows 16-byte aligned (expert_up_fp8 falls back otherwise)"
    x_desc = None if pairs is not None else _e4m3_descriptor(x_q, TILE_M.value)
    grid = (tiles_m * (width // BLOCK),)
    _up_ws_kernel[grid](
        x_desc, x_q, x_q.stride(0), x_s, x_s.stride(0), offsets if pairs is None else pairs,
        offsets, w_desc, s13, s13.stride(0), s13.stride(1), out_q, out_q.stride(0), out_s,
        out_s.stride(0), num_local, top_k, width, depth, tiles_m, SORTED=pairs is not None,
        **_launch_options(num_local, config, BLOCK),
    )  # fmt: skip
    return out_q, out_s


def expert_down_fp8_ws(
    a_q: torch.Tensor,  # [P, I] e4m3
    a_s: torch.Tensor,  # [P, I/128] fp32
    w2: torch.Tensor,  # [L, H, I] e4m3, contiguous
    s2: torch.Tensor,  # [L, H/128, I/128] fp32, contiguous
    offsets: torch.Tensor,  # [L + 1] int32
    pairs: torch.Tensor | None,  # [P] int32 row·K + slot; None: grouped row p is out row p
    weights: torch.Tensor,  # [R, K'] fp32
    out: torch.Tensor,  # [R·K, H] (pairs) or [R, H]
    *,
    config: TileConfig,
) -> torch.Tensor:
    """``expert_down_fp8`` on the warp-specialized kernel (``a_q`` is GEMM1's own buffer: TMA
    reads it)."""
    num_grouped, depth = a_q.shape
    num_local, width, _ = w2.shape
    if num_grouped == 0 or width == 0:
        if pairs is None:
            out.zero_()
        return out
    tiles_m = row_tiles(num_grouped, num_local, TILE_M.value)
    grid = (tiles_m * cdiv(width, 2 * BLOCK),)
    a_desc = _e4m3_descriptor(a_q, TILE_M.value)
    _down_ws_kernel[grid](
        a_desc, a_s, a_s.stride(0), offsets if pairs is None else pairs,
        offsets, _e4m3_descriptor(w2.view(-1, depth), 128), s2, s2.stride(0), s2.stride(1),
        weights, weights.stride(0), weights.stride(1), out, out.stride(0), num_local,
        weights.size(1), width, depth, tiles_m, out.size(0), SORTED=pairs is not None,
        ZERO_PAD=pairs is None, **_launch_options(num_local, config, 2 * BLOCK),
    )  # fmt: skip
    return out
