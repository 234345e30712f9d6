"""Triton kernels for the data-path ops, with the signatures and results of ``torch_ops``.

Every op is bitwise equal to its torch twin (the spec) except ``weighted_activation``, whose silu
may differ in the last bits. None reads a device value on the host: grids come from Python ints,
per-forward sizes (rows per chunk, valid grouped rows, the failure flag) are read inside the
kernels, so capacity mode stays capturable in a CUDA graph. Reductions add in a fixed order and
use no atomics, so two runs are bitwise equal.

Launches per op: route 1, pack 1, local_ids 1, group 3 (count, place, gather), activation 1,
sum 1, each header op 1.

Under ``TRITON_INTERPRET=1`` (the CPU tests) the same kernels run on CPU tensors; the interpreter
truncates fp32 → bf16, so there the rounding is done on the bits (``_rounded``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ep_runtime.kernels.layout import (
    HEADER_BYTES,
    HEADER_INTS,
    ChunkLayout,
    Control,
    Field,
    RowFormat,
)
from ep_runtime.kernels.torch_ops import Grouped, HeaderFields, Route, chunk_starts

INTERPRET = tl.constexpr(bool(triton.knobs.runtime.interpret))

# header columns and control entries, as constexprs the kernels can read
F_STATUS = tl.constexpr(int(Field.STATUS))
F_SEQ = tl.constexpr(int(Field.SEQ))
F_FINGERPRINT = tl.constexpr(int(Field.FINGERPRINT))
F_LAYER = tl.constexpr(int(Field.LAYER))
F_PHASE = tl.constexpr(int(Field.PHASE))
F_TOP_K = tl.constexpr(int(Field.TOP_K))
F_NUM_CHUNKS = tl.constexpr(int(Field.NUM_CHUNKS))
F_NUM_ROWS = tl.constexpr(int(Field.NUM_ROWS))
F_NUM_SLOTS = tl.constexpr(int(Field.NUM_SLOTS))
C_SEQ = tl.constexpr(int(Control.SEQ))
C_BAD_IDS = tl.constexpr(int(Control.BAD_IDS))
C_FAILED_STATUS = tl.constexpr(int(Control.FAILED_STATUS))
C_FAILED_RANK = tl.constexpr(int(Control.FAILED_RANK))
C_FAILED_SEQ = tl.constexpr(int(Control.FAILED_SEQ))
C_FORWARD_FAILED = tl.constexpr(int(Control.FORWARD_FAILED))
HINTS = tl.constexpr(HEADER_INTS)
HBYTES = tl.constexpr(HEADER_BYTES)

MAX_ROW_BLOCK = 2048  # elements of a row one program copies per step
TILE_ELEMENTS = 4096  # bound on the elements of the 2-D/3-D index tiles (registers)

__all__ = [
    "Grouped",
    "HeaderFields",
    "Route",
    "chunk_starts",
    "group_rows",
    "local_ids",
    "pack_rows",
    "read_chunk_headers",
    "record_headers",
    "route_tokens",
    "sum_rows",
    "weighted_activation",
    "write_chunk_headers",
]


def _fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter holds a scalar argument as a 1-element array and converts it with
    ``int(array)``, which NumPy ≥ 2.4 refuses: every loop bounded by a kernel argument fails.
    Under the interpreter only, convert its one element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "ep_runtime_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.ep_runtime_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter_scalars()


# --------------------------------------------------------------------------- launch helpers
def _pow2(n: int) -> int:
    """Smallest power of two ≥ max(n, 1)."""
    return triton.next_power_of_2(max(int(n), 1))


def _row_block(length: int, element_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for programs that each copy BLOCK elements of a row (16 bytes per
    thread per access); above ``MAX_ROW_BLOCK``, the power of two (≥ 512) wasting least."""
    if length <= MAX_ROW_BLOCK:
        block = _pow2(length)
    else:
        candidates = (MAX_ROW_BLOCK, MAX_ROW_BLOCK // 2, MAX_ROW_BLOCK // 4)
        block = min(candidates, key=lambda b: (-(-length // b) * b - length, -b))
    warps = max(1, min(8, block * element_size // 512))
    return block, warps


def _stride_units(stride: int, element_size: int) -> tuple[int, int]:
    """``(stride // unit, unit)`` for the largest unit of at most 16 bytes dividing ``stride``.
    A kernel computing ``row · units · UNIT`` (``UNIT`` a constexpr) knows rows start 16-byte
    aligned and vectorises; Triton only marks integer arguments divisible by 16 elements."""
    unit = max(1, 16 // element_size)
    while stride % unit:
        unit //= 2
    return stride // unit, unit


def _capacity_arg(chunks: ChunkLayout) -> int:
    """The chunk layout for a kernel: capacity, or -1 for exact sizes."""
    return -1 if chunks.capacity is None else chunks.capacity


# --------------------------------------------------------------------------- shared device code
@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 ``x`` → ``dtype``, rounded to nearest even. The interpreter truncates fp32 → bf16,
    so there the rounding is done on the bits (NaN → 0x7FC0, as torch on CPU)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
            bits = tl.where(x != x, 0x7FC0, bits)
            y = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _exp(x):
    """Full-precision fp32 exp (libdevice), as torch's; numpy's under the interpreter."""
    return tl.exp(x) if INTERPRET else libdevice.exp(x)


@triton.jit
def _chunk_starts(
    counts,
    counts_stride,
    world,
    WP: tl.constexpr,
    header_rows,
    capacity,
):
    """``[WP]`` int64 first row of each chunk (entries ≥ world meaningless) and ``[WP]`` token
    rows per chunk, from the per-chunk counts on the device (exact) or the stride (capacity)."""
    w = tl.arange(0, WP)
    rows = tl.load(counts + w * counts_stride, mask=w < world, other=0).to(tl.int64)
    if capacity >= 0:
        starts = w.to(tl.int64) * (header_rows + capacity)
    else:
        sizes = tl.where(w < world, rows + header_rows, 0)
        starts = tl.cumsum(sizes, 0) - sizes
    return starts, rows


# --------------------------------------------------------------------------- route_tokens
@triton.jit
def _route_kernel(
    topk_ids,  # [T, K] int32/int64
    ids_stride_t,
    ids_stride_k,
    ids_out,  # [T, K] int32, contiguous
    dest_slot,  # [T, W] int32, contiguous
    token_of,  # [W, T] int32, contiguous
    header,  # [W, HEADER_INTS] int32
    header_stride,
    control,  # [CONTROL_INTS] int32
    num_tokens,
    num_experts,
    experts_per_rank,
    status,
    fingerprint,
    layer,
    phase,
    top_k_field,
    num_chunks,
    invalid_status,  # nonzero: invalid ids make the status this instead of being counted
    top_k,
    world,
    KP: tl.constexpr,  # top_k padded to a power of two
    WP: tl.constexpr,  # world padded to a power of two
    BT: tl.constexpr,  # tokens per step
    DROP: tl.constexpr,
):
    """One program: tokens in blocks of BT, with running rows per destination (the carry)."""
    seq = tl.load(control + C_SEQ)
    bad_ids = tl.load(control + C_BAD_IDS)
    tl.debug_barrier()  # every thread has read control before any thread writes it
    k = tl.arange(0, KP)
    w = tl.arange(0, WP)
    rows = tl.zeros([WP], dtype=tl.int32)  # token rows so far per destination
    slot_lanes = tl.zeros([BT, WP], dtype=tl.int32)  # (token, slot) pairs per lane, summed last
    dropped_lanes = tl.zeros([BT], dtype=tl.int32)
    for start in range(0, num_tokens, BT):
        t = start + tl.arange(0, BT)
        t_ok = t < num_tokens
        tk_ok = t_ok[:, None] & (k[None, :] < top_k)  # [BT, KP]
        t64 = t.to(tl.int64)
        ids = tl.load(
            topk_ids + t64[:, None] * ids_stride_t + k[None, :] * ids_stride_k,
            mask=tk_ok,
            other=-1,
        ).to(tl.int64)
        if DROP:
            out_of_range = (ids < -1) | (ids >= num_experts)
            ids = tl.where(out_of_range, -1, ids)
        ids = ids.to(tl.int32)  # in range after the drop (as the twin's cast otherwise)
        if DROP:
            # slot k repeats an id of an earlier slot j < k: [BT, KP (k), KP (j)]
            same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
            same = same & (k[None, None, :] < k[None, :, None])
            repeated = tl.max(same.to(tl.int32), axis=2) > 0
            ids = tl.where(repeated, -1, ids)
            dropped_lanes += tl.sum((out_of_range | repeated).to(tl.int32), axis=1)
        tl.store(ids_out + t64[:, None] * top_k + k[None, :], ids, mask=tk_ok)
        owner = tl.where(ids >= 0, tl.where(ids >= 0, ids, 0) // experts_per_rank, -1)
        hit = (owner[:, :, None] == w[None, None, :]) & (w[None, None, :] < world)  # [BT,KP,WP]
        hit = hit.to(tl.int32)
        slot_lanes += tl.sum(hit, axis=1)
        member = tl.max(hit, axis=1) > 0  # [BT, WP]: token t goes to rank w
        running = tl.cumsum(member.to(tl.int32), axis=0) + rows[None, :]  # [BT, WP]
        slot = tl.where(member, running - 1, -1)
        tl.store(
            dest_slot + t64[:, None] * world + w[None, :],
            slot,
            mask=t_ok[:, None] & (w[None, :] < world),
        )
        token_rows = w[None, :].to(tl.int64) * num_tokens  # [1, WP]
        tl.store(token_of + token_rows + slot, t[:, None] + 0 * slot, mask=member)
        rows += tl.sum(member.to(tl.int32), axis=0)
    # token_of past each destination's count
    for start in range(0, num_tokens, BT):
        s = start + tl.arange(0, BT)
        past = (s[:, None] < num_tokens) & (s[:, None] >= rows[None, :]) & (w[None, :] < world)
        tl.store(token_of + w[None, :].to(tl.int64) * num_tokens + s[:, None], -1, mask=past)
    slots = tl.sum(slot_lanes, axis=0)  # [WP]
    dropped = tl.sum(dropped_lanes, axis=0)
    if DROP:  # invalid ids fail this rank's forward (as the header's status) if asked to
        status = tl.where(
            (dropped > 0) & (invalid_status != 0) & (status == 0), invalid_status, status
        )
    f = tl.arange(0, HINTS)[None, :]  # [1, HEADER_INTS]
    values = tl.zeros([WP, HINTS], dtype=tl.int32)
    values = tl.where(f == F_STATUS, status, values)
    values = tl.where(f == F_SEQ, seq, values)
    values = tl.where(f == F_FINGERPRINT, fingerprint, values)
    values = tl.where(f == F_LAYER, layer, values)
    values = tl.where(f == F_PHASE, phase, values)
    values = tl.where(f == F_TOP_K, top_k_field, values)
    values = tl.where(f == F_NUM_CHUNKS, num_chunks, values)
    values = tl.where(f == F_NUM_ROWS, rows[:, None], values)
    values = tl.where(f == F_NUM_SLOTS, slots[:, None], values)
    tl.store(header + w[:, None] * header_stride + f, values, mask=w[:, None] < world)
    tl.store(control + C_SEQ, seq + 1)
    tl.store(control + C_FORWARD_FAILED, 0)
    if DROP:
        tl.store(control + C_BAD_IDS, bad_ids + tl.where(invalid_status == 0, dropped, 0))


def route_tokens(
    topk_ids: torch.Tensor,  # [T, K] int32/int64 global ids, -1 = unused
    *,
    num_experts: int,
    experts_per_rank: int,
    world_size: int,
    drop_invalid: bool,
    control: torch.Tensor,  # [CONTROL_INTS] int32; SEQ read and advanced, BAD_IDS counted
    fields: HeaderFields,
    header_out: torch.Tensor,  # [W, HEADER_INTS] int32: the header sent to each rank
    invalid_status: int = 0,
) -> Route:
    """Destinations and chunk rows of every token, and the header to each rank (one launch;
    ``torch_ops.route_tokens`` is the spec)."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    dest_slot = torch.empty(num_tokens, world_size, dtype=torch.int32, device=device)
    token_of = torch.empty(world_size, num_tokens, dtype=torch.int32, device=device)
    kp, wp = _pow2(top_k), _pow2(world_size)
    # one program walks all tokens: big steps (fewer serial iterations), 8 warps to hold them
    block = max(8, min(256, 2 * TILE_ELEMENTS // (kp * max(kp, wp)), _pow2(num_tokens)))
    _route_kernel[(1,)](
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        ids,
        dest_slot,
        token_of,
        header_out,
        header_out.stride(0),
        control,
        num_tokens,
        num_experts,
        experts_per_rank,
        fields.status,
        fields.fingerprint,
        fields.layer,
        fields.phase,
        fields.top_k,
        fields.num_chunks,
        invalid_status,
        top_k=top_k,
        world=world_size,
        KP=kp,
        WP=wp,
        BT=_pow2(block),
        DROP=drop_invalid,
        num_warps=8,
    )
    return Route(ids, dest_slot, token_of, header_out)


# --------------------------------------------------------------------------- pack_rows
@triton.jit
def _pack_kernel(
    x,  # [T, H] compute dtype
    x_rows,  # row stride in units of X_UNIT elements
    x_stride_h,
    weights,  # [T, K] float
    weights_stride_t,
    weights_stride_k,
    ids,  # [T, K] int32 (the route's)
    ids_stride_t,
    ids_stride_k,
    token_of,  # [W, T] int32
    token_of_stride,
    header,  # [W, HEADER_INTS] int32 (NUM_ROWS: token rows per chunk)
    header_stride,
    send_hidden,  # [S, row_bytes / itemsize] view of the send buffer
    send_words,  # [S, row_bytes / 4] int32 view
    send_floats,  # [S, row_bytes / 4] fp32 view
    row_units,  # row_bytes / 16
    hidden_size,
    top_k,
    max_k,
    KP: tl.constexpr,  # max_k padded to a power of two
    world,
    WP: tl.constexpr,
    header_rows,
    capacity,  # -1: exact chunk sizes
    ids_word,  # first int32 word of the ids in a row
    weights_word,
    header_elements,  # hidden elements the header overlays in a chunk's first row
    POISON: tl.constexpr,
    X_UNIT: tl.constexpr,
    ROW_UNIT: tl.constexpr,  # elements of 16 bytes
    BLOCK_H: tl.constexpr,
):
    """Program (row, block of H): maps its send row to (chunk, slot) and writes the row's hidden
    block; the first block's program also writes the ids, weights and (first header row) the
    header."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    starts, rows = _chunk_starts(
        header + F_NUM_ROWS, header_stride, world, WP, header_rows, capacity
    )
    w = tl.arange(0, WP)
    chunk = tl.sum(((starts <= row) & (w < world)).to(tl.int32), axis=0) - 1
    start = tl.sum(tl.where(w == chunk, starts, 0), axis=0)
    count = tl.sum(tl.where(w == chunk, rows, 0), axis=0)
    within = row - start - header_rows  # token slot in the chunk; < 0 in header rows
    is_token = (within >= 0) & (within < count)
    is_header = within == -header_rows
    token = tl.load(token_of + chunk * token_of_stride + within, mask=is_token, other=0)
    token = token.to(tl.int64)
    row64 = row.to(tl.int64)
    h = block * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden_size
    values = tl.load(
        x + token * x_rows * X_UNIT + h * x_stride_h, mask=in_row & is_token, other=0.0
    )
    if POISON:  # filler hidden: NaN (the load's 0 otherwise); fp32 → dtype is exact here
        values = tl.where(is_token, values.to(tl.float32), float("nan"))
    keep = in_row & ~(is_header & (h < header_elements))  # the header's bytes are its own
    tl.store(send_hidden + row64 * row_units * ROW_UNIT + h, values, mask=keep)
    if block == 0:
        k = tl.arange(0, KP)
        slot_ok = is_token & (k < top_k)
        slot_ids = tl.load(ids + token * ids_stride_t + k * ids_stride_k, mask=slot_ok, other=-1)
        slot_weights = tl.load(
            weights + token * weights_stride_t + k * weights_stride_k, mask=slot_ok, other=0.0
        ).to(tl.float32)
        words = row64 * row_units * 4
        tl.store(send_words + words + ids_word + k, slot_ids, mask=k < max_k)
        tl.store(send_floats + words + weights_word + k, slot_weights, mask=k < max_k)
        f = tl.arange(0, HINTS)
        fields = tl.load(header + chunk * header_stride + f)
        tl.store(send_words + words + f, fields, mask=(f < HINTS) & is_header)


def pack_rows(
    x: torch.Tensor,  # [T, H] compute dtype
    topk_weights: torch.Tensor,  # [T, K] float
    route: Route,
    send: torch.Tensor,  # [S, row_bytes] uint8; every row is written (filler: ids -1)
    row_format: RowFormat,
    chunks: ChunkLayout,
    *,
    poison: bool = False,
) -> None:
    """Write every row of the dispatch send buffer (one launch; ``torch_ops.pack_rows`` is the
    spec). Bytes between the hidden state and the ids (alignment) are left as they are."""
    num_rows, row_bytes = send.shape
    assert send.is_contiguous() and row_bytes == row_format.row_bytes
    world = route.header.size(0)
    top_k = route.ids.size(1)
    hidden_size = row_format.hidden_size
    itemsize = row_format.dtype.itemsize
    block, warps = _row_block(hidden_size, itemsize)
    grid = (num_rows, triton.cdiv(hidden_size, block))
    x_rows, x_unit = _stride_units(x.stride(0), itemsize)
    _pack_kernel[grid](
        x,
        x_rows,
        x.stride(1),
        topk_weights,
        topk_weights.stride(0),
        topk_weights.stride(1),
        route.ids,
        route.ids.stride(0),
        route.ids.stride(1),
        route.token_of,
        route.token_of.stride(0),
        route.header,
        route.header.stride(0),
        send.view(row_format.dtype),
        send.view(torch.int32),
        send.view(torch.float32),
        row_bytes // 16,
        hidden_size,
        top_k=top_k,
        max_k=row_format.max_top_k,
        KP=_pow2(row_format.max_top_k),
        world=world,
        WP=_pow2(world),
        header_rows=chunks.header_rows,
        capacity=_capacity_arg(chunks),
        ids_word=row_format.ids_offset // 4,
        weights_word=row_format.weights_offset // 4,
        header_elements=-(-HEADER_BYTES // itemsize),
        POISON=poison,
        X_UNIT=x_unit,
        ROW_UNIT=16 // itemsize,
        BLOCK_H=block,
        num_warps=warps,
    )


# --------------------------------------------------------------------------- local_ids
@triton.jit
def _local_ids_kernel(
    topk_ids,  # [R, K] int32
    ids_stride_r,
    ids_stride_k,
    out,  # [R, K] int32, contiguous
    num_rows,
    local_offset,
    num_local,
    top_k,
    KP: tl.constexpr,
    BR: tl.constexpr,
):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    k = tl.arange(0, KP)
    ok = (r[:, None] < num_rows) & (k[None, :] < top_k)
    r64 = r.to(tl.int64)[:, None]
    ids = tl.load(topk_ids + r64 * ids_stride_r + k[None, :] * ids_stride_k, mask=ok, other=-1)
    local = ids.to(tl.int64) - local_offset
    served = (local >= 0) & (local < num_local)
    tl.store(out + r64 * top_k + k[None, :], tl.where(served, ids, -1), mask=ok)


def local_ids(
    topk_ids: torch.Tensor,  # [R, K] int32 global ids (a strided view is fine)
    *,
    local_offset: int,
    num_local: int,
) -> torch.Tensor:
    """``[R, K]`` int32: the ids this rank serves, -1 elsewhere (one launch)."""
    num_rows, top_k = topk_ids.shape
    out = torch.empty(num_rows, top_k, dtype=torch.int32, device=topk_ids.device)
    kp = _pow2(top_k)
    block = max(1, min(256, TILE_ELEMENTS // kp))
    if num_rows:
        _local_ids_kernel[(triton.cdiv(num_rows, block),)](
            topk_ids,
            topk_ids.stride(0),
            topk_ids.stride(1),
            out,
            num_rows,
            local_offset,
            num_local,
            top_k=top_k,
            KP=kp,
            BR=block,
        )
    return out


# --------------------------------------------------------------------------- group_rows
@triton.jit
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


@triton.jit
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
            topk_ids,
            ids_stride_r,
            ids_stride_k,
            pairs,
            num_pairs,
            top_k,
            local_offset,
            num_local,
        )
        one_hot = served[:, None] & (expert[:, None] == e[None, :])  # [SUB, LP]
        counts += tl.sum(one_hot.to(tl.int32), axis=0)
    tl.store(block_counts + block * LP + e, counts)


@triton.jit
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
            topk_ids,
            ids_stride_r,
            ids_stride_k,
            pairs,
            num_pairs,
            top_k,
            local_offset,
            num_local,
        )
        one_hot = (served[:, None] & (expert[:, None] == e[None, :])).to(tl.int32)  # [SUB, LP]
        rank = tl.cumsum(one_hot, axis=0) - 1 + base[None, :]
        position = tl.sum(tl.where(one_hot != 0, rank, 0), axis=1)  # [SUB]
        base += tl.sum(one_hot, axis=0)
        placed = served & (position < num_rows)
        tl.store(positions + pairs, tl.where(placed, position, -1), mask=pairs < num_pairs)
        tl.store(source_pair + position, pairs, mask=placed)


@triton.jit
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


def group_rows(
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
    three launches (per-block counts, placement, row gather); ``torch_ops.group_rows`` is the
    spec. Padding hidden rows are left unwritten unless ``poison`` (then NaN)."""
    num_src, top_k = topk_ids.shape
    hidden_size = hidden.size(1)
    num_pairs = num_src * top_k
    device = hidden.device
    lp = _pow2(num_local)
    sub = max(1, min(TILE_ELEMENTS // lp, _pow2(num_pairs)))
    pairs_per_block = max(sub, min(1024, _pow2(-(-num_pairs // 128))))
    num_blocks = triton.cdiv(num_pairs, pairs_per_block)
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
    _group_place_kernel[(max(num_blocks, 1),)](
        *ids_args,
        block_counts,
        positions,
        source_pair,
        offsets,
        num_pairs,
        num_blocks,
        top_k,
        local_offset,
        num_local,
        num_rows,
        BB=max(1, min(64, TILE_ELEMENTS // lp)),
        **sizes,
    )
    if num_rows:
        block, warps = _row_block(hidden_size, hidden.element_size())
        hidden_rows, unit = _stride_units(hidden.stride(0), hidden.element_size())
        out_rows, out_unit = _stride_units(hidden_size, hidden.element_size())
        _group_gather_kernel[(num_rows, triton.cdiv(hidden_size, block))](
            hidden,
            hidden_rows,
            hidden.stride(1),
            *ids_args,
            topk_weights,
            topk_weights.stride(0),
            topk_weights.stride(1),
            source_pair,
            offsets,
            out_hidden,
            out_weights,
            out_ids,
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


# --------------------------------------------------------------------------- weighted_activation
@triton.jit
def _activation_kernel(
    h,  # [N, 2I] ([gate | up]) or [N, I]
    h_rows,  # row stride in units of H_UNIT elements
    h_stride_i,
    weights,  # [N] fp32
    out,  # [N, I], contiguous
    width_units,  # I in units of W_UNIT elements
    GATED: tl.constexpr,
    H_UNIT: tl.constexpr,
    W_UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, block of I): fp32 math, one rounding."""
    row = tl.program_id(0).to(tl.int64)
    width = width_units * W_UNIT
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < width
    first = h + row * h_rows * H_UNIT + i * h_stride_i
    weight = tl.load(weights + row)
    if GATED:
        gate = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(first + width * h_stride_i, mask=ok, other=0.0).to(tl.float32)
        activated = tl.math.div_rn(gate, 1.0 + _exp(-gate)) * up  # silu(gate)·up, as torch
    else:
        value = tl.load(first, mask=ok, other=0.0).to(tl.float32)
        relu = tl.where(value < 0.0, 0.0, value)  # NaN stays NaN, as torch.relu
        activated = relu * relu
    result = activated * weight
    tl.store(out + row * width + i, _rounded(result, out.dtype.element_ty), mask=ok)


def weighted_activation(
    h: torch.Tensor,  # [N, 2I] gated ([gate | up]) or [N, I], compute dtype
    weights: torch.Tensor,  # [N] fp32 router weight per row
    *,
    gated: bool,
) -> torch.Tensor:
    """``[N, I]``: ``silu(gate)·up·w`` or ``relu(h)²·w``, in fp32, rounded once to h's dtype
    (one launch). silu may differ from torch's in the last bits."""
    num_rows = h.size(0)
    width = h.size(1) // 2 if gated else h.size(1)
    out = torch.empty(num_rows, width, dtype=h.dtype, device=h.device)
    if num_rows and width:
        block, warps = _row_block(width, h.element_size())
        h_rows, h_unit = _stride_units(h.stride(0), h.element_size())
        width_units, w_unit = _stride_units(width, h.element_size())
        _activation_kernel[(num_rows, triton.cdiv(width, block))](
            h,
            h_rows,
            h.stride(1),
            weights,
            out,
            width_units,
            GATED=gated,
            H_UNIT=h_unit,
            W_UNIT=w_unit,
            BLOCK=block,
            num_warps=warps,
        )
    return out


# --------------------------------------------------------------------------- sum_rows
@triton.jit
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
    tl.store(dest, _rounded(total, out.dtype.element_ty), mask=in_row)


def sum_rows(
    source: torch.Tensor,  # [S, H]
    positions: torch.Tensor,  # [T, J] int32 rows of source to add, -1 = nothing
    out: torch.Tensor | None = None,  # [T, H]; a strided view is fine
    *,
    chunk_counts: torch.Tensor | None = None,  # [J] token rows per chunk of ``source``
    chunks: ChunkLayout | None = None,  # given: position (t, j) is a row of source's chunk j
    failed: torch.Tensor | None = None,  # 0-d int: nonzero → every output row is NaN
) -> torch.Tensor:
    """``out[t] = Σ_j source[row(t, j)]`` in fp32, adding j = 0, 1, … in order, rounded once
    (one launch; ``torch_ops.sum_rows`` is the spec). No atomics: deterministic."""
    num_out, num_terms = positions.shape
    hidden_size = source.size(1)
    if out is None:
        out = torch.empty(num_out, hidden_size, dtype=source.dtype, device=source.device)
    if chunks is not None:
        assert chunk_counts is not None
    if num_out == 0 or hidden_size == 0:
        return out
    block, warps = _row_block(hidden_size, source.element_size())
    source_rows, source_unit = _stride_units(source.stride(0), source.element_size())
    out_rows, out_unit = _stride_units(out.stride(0), out.element_size())
    counts = chunk_counts if chunk_counts is not None else positions  # unread without chunks
    flag = failed if failed is not None else positions  # unread without ``failed``
    _sum_kernel[(num_out, triton.cdiv(hidden_size, block))](
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
        _capacity_arg(chunks) if chunks is not None else -1,
        CHUNKED=chunks is not None,
        HAS_FAILED=failed is not None,
        SOURCE_UNIT=source_unit,
        OUT_UNIT=out_unit,
        JB=min(4, _pow2(num_terms)),
        BLOCK_H=block,
        num_warps=warps,
    )
    return out


# --------------------------------------------------------------------------- headers
@triton.jit
def _record_headers_kernel(
    received,  # [W, HEADER_INTS] int32
    received_stride,
    control,  # [CONTROL_INTS] int32
    rank,
    PHASE: tl.constexpr,
    top_k,
    mismatch_status,
    world,
    WP: tl.constexpr,
):
    """One program: the checks of ``torch_ops.record_headers`` on a [W, HEADER_INTS] tile."""
    w = tl.arange(0, WP)
    f = tl.arange(0, HINTS)[None, :]
    peer = w < world
    tile = tl.load(received + w[:, None] * received_stride + f, mask=peer[:, None], other=0)
    status = tl.sum(tl.where(f == F_STATUS, tile, 0), axis=1)  # [WP]
    seq = tl.sum(tl.where(f == F_SEQ, tile, 0), axis=1)
    fingerprint = tl.sum(tl.where(f == F_FINGERPRINT, tile, 0), axis=1)
    layer = tl.sum(tl.where(f == F_LAYER, tile, 0), axis=1)
    phase = tl.sum(tl.where(f == F_PHASE, tile, 0), axis=1)
    their_k = tl.sum(tl.where(f == F_TOP_K, tile, 0), axis=1)
    own = w == rank
    mismatch = (phase != PHASE) | (fingerprint != tl.sum(tl.where(own, fingerprint, 0), axis=0))
    mismatch = mismatch | (layer != tl.sum(tl.where(own, layer, 0), axis=0))
    if PHASE == 1:
        mismatch = mismatch | (seq != tl.sum(tl.where(own, seq, 0), axis=0))
        if top_k != 0:
            mismatch = mismatch | ((their_k != top_k) & (their_k != 0))
    code = tl.where(status != 0, status, tl.where(mismatch, mismatch_status, 0))
    code = tl.where(own | ~peer, 0, code)
    failed = code != 0
    any_failed = tl.max(failed.to(tl.int32), axis=0)
    first = tl.min(tl.where(failed, w, WP), axis=0)  # first failed rank (WP: none)
    first_code = tl.sum(tl.where(w == first, code, 0), axis=0)
    first_seq = tl.sum(tl.where(w == first, seq, 0), axis=0)
    forward_failed = tl.load(control + C_FORWARD_FAILED)
    failed_status = tl.load(control + C_FAILED_STATUS)
    failed_rank = tl.load(control + C_FAILED_RANK)
    failed_seq = tl.load(control + C_FAILED_SEQ)
    tl.debug_barrier()  # every thread has read control before any thread writes it
    new = (failed_status == 0) & (any_failed != 0)
    tl.store(control + C_FORWARD_FAILED, forward_failed | any_failed)
    tl.store(control + C_FAILED_STATUS, tl.where(new, first_code, failed_status))
    tl.store(control + C_FAILED_RANK, tl.where(new, first, failed_rank))
    tl.store(control + C_FAILED_SEQ, tl.where(new, first_seq, failed_seq))
    if PHASE == 1:
        highest = tl.max(tl.where(peer, seq, -2147483648), axis=0)
        tl.store(control + C_SEQ, highest + 1)


def record_headers(
    received: torch.Tensor,  # [W, HEADER_INTS] int32: the header from each rank
    control: torch.Tensor,  # [CONTROL_INTS] int32
    *,
    rank: int,
    phase: int,
    top_k: int,  # this rank's K, 0 = any (dispatch only)
    mismatch_status: int,
) -> None:
    """Record peers' failures and mismatched headers in ``control`` without a host sync (one
    launch; ``torch_ops.record_headers`` is the spec)."""
    world = received.size(0)
    _record_headers_kernel[(1,)](
        received,
        received.stride(0),
        control,
        rank=rank,
        PHASE=phase,
        top_k=top_k,
        mismatch_status=mismatch_status,
        world=world,
        WP=_pow2(world),
    )


@triton.jit
def _chunk_headers_kernel(
    buffer,  # [S · row_bytes] uint8
    header,  # [W, HEADER_BYTES] uint8 (read: out) or [HEADER_BYTES] (write: in)
    chunk_counts,  # [W] token rows per chunk
    counts_stride,
    row_bytes,
    world,
    WP: tl.constexpr,
    header_rows,
    capacity,
    WRITE: tl.constexpr,
):
    """One program: the first HEADER_BYTES bytes of every chunk, written from or read into
    ``header`` byte by byte (a chunk may start at any byte)."""
    starts, _ = _chunk_starts(chunk_counts, counts_stride, world, WP, header_rows, capacity)
    w = tl.arange(0, WP)[:, None]
    b = tl.arange(0, HBYTES)[None, :]
    at = buffer + starts[:, None] * row_bytes + b  # [WP, HEADER_BYTES]
    peer = (w < world) & (b < HBYTES)
    if WRITE:
        tl.store(at, tl.load(header + b + 0 * w), mask=peer)
    else:
        tl.store(header + w * HBYTES + b, tl.load(at, mask=peer), mask=peer)


def _chunk_headers(
    buffer: torch.Tensor,
    header: torch.Tensor,
    chunk_counts: torch.Tensor,
    chunks: ChunkLayout,
    *,
    write: bool,
) -> None:
    assert buffer.is_contiguous()
    world = chunk_counts.size(0)
    _chunk_headers_kernel[(1,)](
        buffer.view(-1).view(torch.uint8),
        header,
        chunk_counts,
        chunk_counts.stride(0),
        buffer.size(1) * buffer.element_size(),
        world=world,
        WP=_pow2(world),
        header_rows=chunks.header_rows,
        capacity=_capacity_arg(chunks),
        WRITE=write,
    )


def write_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous, chunks of header rows then token rows
    header: torch.Tensor,  # [HEADER_INTS] int32, written at the start of every chunk
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> None:
    """One launch."""
    _chunk_headers(buffer, header.contiguous().view(torch.uint8), chunk_counts, chunks, write=True)


def read_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> torch.Tensor:
    """``[W, HEADER_INTS]`` int32: the header at the start of each chunk (one launch)."""
    out = torch.empty(chunk_counts.size(0), HEADER_BYTES, dtype=torch.uint8, device=buffer.device)
    _chunk_headers(buffer, out, chunk_counts, chunks, write=False)
    return out.view(torch.int32)
