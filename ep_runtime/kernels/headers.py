"""Header ops on the device: a combine status written into and read from every chunk
(``write_chunk_headers``, ``read_chunk_headers``), and the received headers checked against this
rank's (``record_headers``, capacity mode on CUDA).

The torch function is the spec (and the CPU path); the Triton one is bitwise equal to it and
reads no device value on the host.
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.layout import ChunkLayout, chunk_starts
from ep_runtime.kernels.triton_common import (
    C_FAILED_RANK,
    C_FAILED_SEQ,
    C_FAILED_STATUS,
    C_FORWARD_FAILED,
    C_SEQ,
    F_FINGERPRINT,
    F_LAYER,
    F_PHASE,
    F_SEQ,
    F_STATUS,
    F_TOP_K,
    HBYTES,
    HINTS,
    capacity_arg,
    device_chunk_starts,
    kernel,
    pow2,
    tl,
)
from ep_runtime.kernels.wire import HEADER_BYTES, Control, Field


def _header_bytes_index(
    buffer: torch.Tensor, chunk_counts: torch.Tensor, chunks: ChunkLayout
) -> torch.Tensor:
    """``[W, HEADER_BYTES]`` byte offsets of each chunk's header in ``buffer`` (contiguous)."""
    row_bytes = buffer.size(1) * buffer.element_size()
    starts = chunk_starts(chunk_counts, chunks) * row_bytes  # [W]
    return starts.unsqueeze(1) + torch.arange(HEADER_BYTES, device=buffer.device)


def torch_write_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous, chunks of header rows then token rows
    header: torch.Tensor,  # [HEADER_INTS] int32, written at the start of every chunk
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> None:
    index = _header_bytes_index(buffer, chunk_counts, chunks)
    flat = buffer.view(-1).view(torch.uint8)
    flat[index] = header.view(torch.uint8).unsqueeze(0).expand_as(index)


def torch_read_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> torch.Tensor:
    """``[W, HEADER_INTS]`` int32: the header at the start of each chunk."""
    index = _header_bytes_index(buffer, chunk_counts, chunks)
    return buffer.view(-1).view(torch.uint8)[index].view(torch.int32)


def torch_record_headers(
    received: torch.Tensor,  # [W, HEADER_INTS] int32: the header from each rank
    control: torch.Tensor,  # [CONTROL_INTS] int32
    *,
    rank: int,
    phase: int,
    top_k: int,  # this rank's K, 0 = any (dispatch only)
    mismatch_status: int,
) -> None:
    """Record, without a host sync, the peers' failures and headers that do not match this
    rank's: ``control[FORWARD_FAILED]`` for this forward, and the first failure since the last
    check (status, rank, forward number). On dispatch, the forward counter resynchronises to one
    past the highest one seen, so a skipped forward is reported once."""
    own = received[rank]
    mismatch = (received[:, Field.PHASE] != phase) | (
        received[:, Field.FINGERPRINT] != own[Field.FINGERPRINT]
    )
    mismatch |= received[:, Field.LAYER] != own[Field.LAYER]
    dispatch = phase == 1
    if dispatch:
        mismatch |= received[:, Field.SEQ] != own[Field.SEQ]
        k = received[:, Field.TOP_K]
        if top_k:
            mismatch |= (k != top_k) & (k != 0)
    status = received[:, Field.STATUS]
    code = torch.where(status != 0, status, torch.where(mismatch, mismatch_status, 0))
    code[rank] = 0  # this rank's own failure was raised here already
    failed = code != 0
    any_failed = failed.any().to(torch.int32)
    first = torch.argmax(failed.to(torch.int32))
    new = (control[Control.FAILED_STATUS] == 0) & (any_failed != 0)
    control[Control.FORWARD_FAILED] |= any_failed
    control[Control.FAILED_STATUS] = torch.where(new, code[first], control[Control.FAILED_STATUS])
    control[Control.FAILED_RANK] = torch.where(
        new, first.to(torch.int32), control[Control.FAILED_RANK]
    )
    control[Control.FAILED_SEQ] = torch.where(
        new, received[first, Field.SEQ], control[Control.FAILED_SEQ]
    )
    if dispatch:
        control[Control.SEQ] = received[:, Field.SEQ].max() + 1


# --------------------------------------------------------------------------- Triton
@kernel
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
    """One program: the checks of ``torch_record_headers`` on a [W, HEADER_INTS] tile."""
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


def triton_record_headers(
    received: torch.Tensor,  # [W, HEADER_INTS] int32: the header from each rank
    control: torch.Tensor,  # [CONTROL_INTS] int32
    *,
    rank: int,
    phase: int,
    top_k: int,  # this rank's K, 0 = any (dispatch only)
    mismatch_status: int,
) -> None:
    """Record peers' failures and mismatched headers in ``control`` without a host sync (one
    launch; ``torch_record_headers`` is the spec)."""
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
        WP=pow2(world),
    )


@kernel
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
    starts, _ = device_chunk_starts(chunk_counts, counts_stride, world, WP, header_rows, capacity)
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
        WP=pow2(world),
        header_rows=chunks.header_rows,
        capacity=capacity_arg(chunks),
        WRITE=write,
    )


def triton_write_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous, chunks of header rows then token rows
    header: torch.Tensor,  # [HEADER_INTS] int32, written at the start of every chunk
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> None:
    """One launch."""
    _chunk_headers(buffer, header.contiguous().view(torch.uint8), chunk_counts, chunks, write=True)


def triton_read_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> torch.Tensor:
    """``[W, HEADER_INTS]`` int32: the header at the start of each chunk (one launch)."""
    out = torch.empty(chunk_counts.size(0), HEADER_BYTES, dtype=torch.uint8, device=buffer.device)
    _chunk_headers(buffer, out, chunk_counts, chunks, write=False)
    return out.view(torch.int32)
