"""``pack_rows``: every row of the dispatch send buffer (headers, token rows, filler).

The torch function is the spec (and the CPU path); the Triton one is bitwise equal to it and
reads no device value on the host. With a quantized row format (fp8 dispatch) pack quantizes
each token row by the contract (``quantization.quantize_activations``) and writes its e4m3
values and scales; rows without a token get code 0 and scale 0 (NaN code and scale in poison
mode).
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.fp8_quant import quantize_groups
from ep_runtime.kernels.layout import ChunkLayout, RowFormat, chunk_starts
from ep_runtime.kernels.triton_common import (
    F_NUM_ROWS,
    HINTS,
    capacity_arg,
    cdiv,
    device_chunk_starts,
    kernel,
    pow2,
    row_block,
    stride_units,
    tl,
)
from ep_runtime.kernels.types import Route
from ep_runtime.kernels.wire import HEADER_BYTES, Field
from ep_runtime.quantization import BLOCK, FP8_DTYPE, quantize_activations

E4M3_NAN = 0x7F  # the e4m3fn code of NaN (positive sign), poison filler


def torch_pack_rows(
    x: torch.Tensor,  # [T, H] compute dtype
    topk_weights: torch.Tensor,  # [T, K] float
    route: Route,
    send: torch.Tensor,  # [S, row_bytes] uint8; every row is written (filler: ids -1)
    row_format: RowFormat,
    chunks: ChunkLayout,
    *,
    poison: bool = False,
) -> None:
    """Write every row of the dispatch send buffer: per destination its header row(s) (the
    header's fields, then filler), its token rows (hidden, ids padded with -1, weights padded with
    0), and in capacity mode filler rows (ids -1, weights 0). Filler hidden is 0, NaN when
    ``poison``. Bytes between the hidden state and the ids (alignment) are left as they are."""
    num_tokens, top_k = route.ids.shape
    num_rows = send.size(0)
    device = send.device
    max_k = row_format.max_top_k
    rows = route.header[:, Field.NUM_ROWS].to(torch.int64)  # [W]
    starts = chunk_starts(rows, chunks)  # [W]
    row = torch.arange(num_rows, device=device)
    dest = torch.searchsorted(starts, row, right=True) - 1  # [S] chunk of each send row
    within = row - starts[dest] - chunks.header_rows  # [S] token slot, < 0 in header rows
    is_token = (within >= 0) & (within < rows[dest])
    if num_tokens:
        token = route.token_of.to(torch.int64)[dest, within.clamp(0, num_tokens - 1)]
        token = torch.where(is_token, token, num_tokens)  # T = the filler row below
    else:
        token = torch.zeros_like(row)
    filler = float("nan") if poison else 0.0
    if row_format.quantized:
        q, scale = quantize_activations(x)  # [T, H] e4m3, [T, H/128] fp32
        code = torch.full((1, x.size(1)), E4M3_NAN if poison else 0, dtype=torch.uint8)
        q_rows = torch.cat([q, code.to(device).view(FP8_DTYPE)])  # [T + 1, H]
        s_rows = torch.cat([scale, scale.new_full((1, scale.size(1)), filler)])
        row_format.hidden(send).copy_(q_rows.index_select(0, token))
        row_format.scales(send).copy_(s_rows.index_select(0, token))
    else:
        x_rows = torch.cat([x, x.new_full((1, x.size(1)), filler)])  # [T + 1, H]
        row_format.hidden(send).copy_(x_rows.index_select(0, token))
    ids = torch.full((num_tokens + 1, max_k), -1, dtype=torch.int32, device=device)
    ids[:num_tokens, :top_k] = route.ids
    row_format.ids(send, max_k).copy_(ids.index_select(0, token))
    weights = torch.zeros(num_tokens + 1, max_k, dtype=torch.float32, device=device)
    weights[:num_tokens, :top_k] = topk_weights.float()
    row_format.weights(send, max_k).copy_(weights.index_select(0, token))
    row_format.header(send)[starts] = route.header


# --------------------------------------------------------------------------- Triton
@kernel
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
    scales_word,  # first fp32 word of the scales in a row (QUANTIZED)
    POISON: tl.constexpr,
    FILLER_CODE: tl.constexpr,  # e4m3 code of filler hidden (QUANTIZED): 0, or NaN (POISON)
    QUANTIZED: tl.constexpr,  # e4m3 hidden and scales: BLOCK_H a multiple of GROUP
    GROUP: tl.constexpr,
    X_UNIT: tl.constexpr,
    ROW_UNIT: tl.constexpr,  # elements of 16 bytes
    BLOCK_H: tl.constexpr,
):
    """Program (row, block of H): maps its send row to (chunk, slot) and writes the row's hidden
    block; the first block's program also writes the ids, weights and (first header row) the
    header."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    starts, rows = device_chunk_starts(
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
    keep = in_row & ~(is_header & (h < header_elements))  # the header's bytes are its own
    if QUANTIZED:  # per 128-column group: e4m3 codes (as bytes) and the group's scale
        groups: tl.constexpr = BLOCK_H // GROUP
        codes, scale = quantize_groups(tl.reshape(values.to(tl.float32), (groups, GROUP)), 1)
        bits = tl.reshape(codes.to(tl.uint8, bitcast=True), (BLOCK_H,))
        bits = tl.where(is_token, bits, FILLER_CODE).to(tl.uint8)
        tl.store(send_hidden + row64 * row_units * ROW_UNIT + h, bits, mask=keep)
        scale = tl.where(is_token, scale, float("nan") if POISON else 0.0)
        g = block * groups + tl.arange(0, groups)
        words = row64 * row_units * 4 + scales_word
        tl.store(send_floats + words + g, scale, mask=g * GROUP < hidden_size)
    else:
        if POISON:  # filler hidden: NaN (the load's 0 otherwise); fp32 → dtype is exact here
            values = tl.where(is_token, values.to(tl.float32), float("nan"))
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


def triton_pack_rows(
    x: torch.Tensor,  # [T, H] compute dtype
    topk_weights: torch.Tensor,  # [T, K] float
    route: Route,
    send: torch.Tensor,  # [S, row_bytes] uint8; every row is written (filler: ids -1)
    row_format: RowFormat,
    chunks: ChunkLayout,
    *,
    poison: bool = False,
) -> None:
    """Write every row of the dispatch send buffer (one launch; ``torch_pack_rows`` is the
    spec). Bytes between the hidden state and the ids (alignment) are left as they are."""
    num_rows, row_bytes = send.shape
    assert send.is_contiguous() and row_bytes == row_format.row_bytes
    world = route.header.size(0)
    top_k = route.ids.size(1)
    hidden_size = row_format.hidden_size
    itemsize = row_format.dtype.itemsize
    block, warps = row_block(hidden_size, itemsize)
    quantized = row_format.quantized
    if quantized:  # whole groups per program (a power of two ≥ 128; H is a multiple of 128)
        block = max(BLOCK, block)
    wire_itemsize = row_format.hidden_dtype.itemsize
    grid = (num_rows, cdiv(hidden_size, block))
    x_rows, x_unit = stride_units(x.stride(0), itemsize)
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
        send if quantized else send.view(row_format.dtype),
        send.view(torch.int32),
        send.view(torch.float32),
        row_bytes // 16,
        hidden_size,
        top_k=top_k,
        max_k=row_format.max_top_k,
        KP=pow2(row_format.max_top_k),
        world=world,
        WP=pow2(world),
        header_rows=chunks.header_rows,
        capacity=capacity_arg(chunks),
        ids_word=row_format.ids_offset // 4,
        weights_word=row_format.weights_offset // 4,
        header_elements=-(-HEADER_BYTES // wire_itemsize),
        scales_word=hidden_size // 4 if quantized else 0,
        POISON=poison,
        FILLER_CODE=E4M3_NAN if poison else 0,
        QUANTIZED=quantized,
        GROUP=BLOCK,
        X_UNIT=x_unit,
        ROW_UNIT=16 // wire_itemsize,
        BLOCK_H=block,
        num_warps=warps,
    )
