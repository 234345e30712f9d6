"""Plain-torch implementations of the data-path ops: the CPU path, and the oracle every GPU kernel
in ``triton_ops`` is tested against. No op here reads a device value on the host, so they are
also safe on CUDA inside capacity mode (no host sync) where Triton is missing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ep_runtime.kernels.layout import (
    HEADER_BYTES,
    ChunkLayout,
    Control,
    Field,
    RowFormat,
)


@dataclass(frozen=True)
class HeaderFields:
    """The protocol's part of a forward header; the route adds the per-destination counts."""

    status: int
    fingerprint: int
    layer: int
    phase: int
    top_k: int
    num_chunks: int


@dataclass(frozen=True)
class Route:
    """Where this rank's tokens go."""

    ids: torch.Tensor  # [T, K] int32 ids, -1 = unused (invalid ids dropped in drop mode)
    dest_slot: torch.Tensor  # [T, W] int32 token row within rank d's chunk, -1 = not sent
    token_of: torch.Tensor  # [W, T] int32 token at each row of rank d's chunk, -1 past its count
    header: torch.Tensor  # [W, HEADER_INTS] int32 header sent to each rank


@dataclass(frozen=True)
class Grouped:
    """Rows regrouped by local expert (EXPANDED): one row per served (row, slot) pair, ordered by
    (expert, row, slot); rows past ``offsets[L]`` are padding."""

    hidden: torch.Tensor  # [N, H] (padding rows undefined, NaN in poison mode)
    weights: torch.Tensor  # [N] fp32 router weight per row (0 for padding, NaN in poison mode)
    ids: torch.Tensor  # [N] int32 global expert id, -1 for padding
    positions: torch.Tensor  # [R, K] int32 grouped row of each source (row, slot), -1 = none
    offsets: torch.Tensor  # [L + 1] int32 group starts; offsets[L] = valid rows


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
    """Destinations and chunk rows of every token, and the header to each rank.

    ``drop_invalid``: ids out of ``[0, E)`` (other than -1) and repeats within a row become -1.
    They are counted in ``control[BAD_IDS]``, or, with a nonzero ``invalid_status``, make the
    header's status that (where ``fields.status`` is OK): every rank then learns of the bad
    input from the header exchange, at no extra cost to good input."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.to(torch.int64)
    if drop_invalid:
        out_of_range = (ids < -1) | (ids >= num_experts)
        ids = ids.masked_fill(out_of_range, -1)
        later = torch.arange(top_k, device=device)
        same = (ids.unsqueeze(2) == ids.unsqueeze(1)) & (ids.unsqueeze(2) >= 0)  # [T, K, K]
        repeated = (same & (later.view(1, 1, -1) < later.view(1, -1, 1))).any(dim=2)
        ids = ids.masked_fill(repeated, -1)
        dropped = (out_of_range.sum() + repeated.sum()).to(torch.int32)
        if not invalid_status:
            control[Control.BAD_IDS] += dropped
    owner = torch.where(ids >= 0, ids // experts_per_rank, world_size)  # [T, K], W = unused
    mask = torch.zeros(num_tokens, world_size + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, owner, True)
    mask = mask[:, :world_size]  # [T, W]
    running = mask.to(torch.int32).cumsum(0, dtype=torch.int32)
    dest_slot = torch.where(mask, running - 1, -1).to(torch.int32)
    rows = mask.sum(0, dtype=torch.int32)  # [W]
    slots = torch.zeros(world_size + 1, dtype=torch.int32, device=device)
    slots.scatter_add_(0, owner.reshape(-1), torch.ones_like(owner, dtype=torch.int32).reshape(-1))
    # token_of[d, slot] = t, through a trash column T for pairs that are not sent
    token_of = torch.full((world_size, num_tokens + 1), -1, dtype=torch.int32, device=device)
    target = torch.where(mask, dest_slot, num_tokens).t().to(torch.int64)  # [W, T]
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=device).expand(world_size, -1)
    token_of.scatter_(1, target, tokens)
    control[Control.FORWARD_FAILED] = 0
    header = header_out
    header.zero_()
    header[:, Field.STATUS] = fields.status
    if drop_invalid and invalid_status and fields.status == 0:
        header[:, Field.STATUS] = torch.where(dropped > 0, invalid_status, 0)
    header[:, Field.SEQ] = control[Control.SEQ]
    header[:, Field.FINGERPRINT] = fields.fingerprint
    header[:, Field.LAYER] = fields.layer
    header[:, Field.PHASE] = fields.phase
    header[:, Field.TOP_K] = fields.top_k
    header[:, Field.NUM_CHUNKS] = fields.num_chunks
    header[:, Field.NUM_ROWS] = rows
    header[:, Field.NUM_SLOTS] = slots[:world_size]
    control[Control.SEQ] += 1
    return Route(ids.to(torch.int32), dest_slot, token_of[:, :num_tokens], header)


def chunk_starts(rows: torch.Tensor, chunks: ChunkLayout) -> torch.Tensor:
    """``[W]`` int64 first row (header) of each peer's chunk, for per-peer token counts ``rows``."""
    world = rows.numel()
    if chunks.capacity is not None:
        stride = chunks.header_rows + chunks.capacity
        return torch.arange(world, dtype=torch.int64, device=rows.device) * stride
    sizes = rows.to(torch.int64) + chunks.header_rows
    return sizes.cumsum(0) - sizes


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
    x_rows = torch.cat([x, x.new_full((1, x.size(1)), filler)])  # [T + 1, H]
    row_format.hidden(send).copy_(x_rows.index_select(0, token))
    ids = torch.full((num_tokens + 1, max_k), -1, dtype=torch.int32, device=device)
    ids[:num_tokens, :top_k] = route.ids
    row_format.ids(send, max_k).copy_(ids.index_select(0, token))
    weights = torch.zeros(num_tokens + 1, max_k, dtype=torch.float32, device=device)
    weights[:num_tokens, :top_k] = topk_weights.float()
    row_format.weights(send, max_k).copy_(weights.index_select(0, token))
    row_format.header(send)[starts] = route.header


def local_ids(
    topk_ids: torch.Tensor,  # [R, K] int32 global ids (a strided view is fine)
    *,
    local_offset: int,
    num_local: int,
) -> torch.Tensor:
    """``[R, K]`` int32: the ids this rank serves, -1 elsewhere."""
    local = topk_ids.to(torch.int64) - local_offset
    served = (local >= 0) & (local < num_local)
    return torch.where(served, topk_ids.to(torch.int32), -1)


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
    """Counting sort of the served (row, slot) pairs by local expert, stable in (row, slot).

    ``num_rows`` is the grouped row count: exact, or a static bound; a pair that would land at or
    past it (only possible for malformed input, e.g. repeated ids) is dropped."""
    num_src, top_k = topk_ids.shape
    num_pairs = num_src * top_k
    device = hidden.device
    filler = float("nan") if poison else 0.0
    local = topk_ids.to(torch.int64) - local_offset
    served = ((local >= 0) & (local < num_local)).reshape(-1)  # [R·K]
    key = torch.where(served, local.reshape(-1), num_local)  # L = not served
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    ends = counts[:num_local].cumsum(0).clamp(max=num_rows)  # [L]
    offsets = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)  # [L + 1]
    order = torch.sort(key, stable=True).indices  # served pairs first, by (expert, row, slot)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_pairs, device=device)
    positions = torch.where(served & (rank < num_rows), rank, -1).view(num_src, top_k)
    grouped_hidden = torch.full(
        (num_rows, hidden.size(1)), filler, dtype=hidden.dtype, device=device
    )
    grouped_weights = torch.full((num_rows,), filler, dtype=torch.float32, device=device)
    grouped_ids = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    if num_pairs and num_rows:
        source_pair = torch.cat([order, order.new_zeros(max(0, num_rows - num_pairs))])[:num_rows]
        valid = torch.arange(num_rows, device=device) < ends[-1]  # [N]
        source_row = source_pair // top_k
        grouped_hidden = torch.where(
            valid.unsqueeze(1), hidden.index_select(0, source_row), grouped_hidden
        )
        weights = topk_weights.reshape(-1).float().index_select(0, source_pair)
        grouped_weights = torch.where(valid, weights, grouped_weights)
        expert = key.index_select(0, source_pair) + local_offset
        grouped_ids = torch.where(valid, expert.to(torch.int32), grouped_ids)
    return Grouped(
        hidden=grouped_hidden,
        weights=grouped_weights,
        ids=grouped_ids,
        positions=positions.to(torch.int32),
        offsets=offsets,
    )


def weighted_activation(
    h: torch.Tensor,  # [N, 2I] gated ([gate | up]) or [N, I], compute dtype
    weights: torch.Tensor,  # [N] fp32 router weight per row
    *,
    gated: bool,
) -> torch.Tensor:
    """``[N, I]``: ``silu(gate)·up·w`` or ``relu(h)²·w``, in fp32, rounded once to h's dtype."""
    h32 = h.float()
    if gated:
        half = h32.size(1) // 2
        activated = F.silu(h32[:, :half]) * h32[:, half:]
    else:
        activated = torch.relu(h32).square()
    return (activated * weights.unsqueeze(1)).to(h.dtype)


def sum_rows(
    source: torch.Tensor,  # [S, H]
    positions: torch.Tensor,  # [T, J] int32 rows of source to add, -1 = nothing
    out: torch.Tensor | None = None,  # [T, H]; a strided view is fine
    *,
    chunk_counts: torch.Tensor | None = None,  # [J] token rows per chunk of ``source``
    chunks: ChunkLayout | None = None,  # given: position (t, j) is a row of source's chunk j
    failed: torch.Tensor | None = None,  # 0-d int: nonzero → every output row is NaN
) -> torch.Tensor:
    """``out[t] = Σ_j source[row(t, j)]`` in fp32, adding j = 0, 1, … in order, rounded once;
    ``row(t, j)`` is ``positions[t, j]``, or with ``chunks`` that token row of chunk j.

    Deterministic (no atomics); a row no position refers to (padding, NaN) never enters a sum; a
    row with no positions is exactly zero."""
    num_out = positions.size(0)
    rows = positions.to(torch.int64)
    if chunks is not None:
        assert chunk_counts is not None
        base = chunk_starts(chunk_counts, chunks) + chunks.header_rows  # [J]
        rows = torch.where(rows >= 0, rows + base, -1)
    total = torch.zeros(num_out, source.size(1), dtype=torch.float32, device=source.device)
    if source.size(0):
        for column in rows.t():
            used = (column >= 0).unsqueeze(1)
            picked = source.index_select(0, column.clamp(min=0))
            total += torch.where(used, picked.float(), 0.0)
    if failed is not None:
        total = torch.where(failed != 0, float("nan"), total)
    if out is None:
        return total.to(source.dtype)
    out.copy_(total)
    return out


def _header_bytes_index(
    buffer: torch.Tensor, chunk_counts: torch.Tensor, chunks: ChunkLayout
) -> torch.Tensor:
    """``[W, HEADER_BYTES]`` byte offsets of each chunk's header in ``buffer`` (contiguous)."""
    row_bytes = buffer.size(1) * buffer.element_size()
    starts = chunk_starts(chunk_counts, chunks) * row_bytes  # [W]
    return starts.unsqueeze(1) + torch.arange(HEADER_BYTES, device=buffer.device)


def write_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous, chunks of header rows then token rows
    header: torch.Tensor,  # [HEADER_INTS] int32, written at the start of every chunk
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> None:
    index = _header_bytes_index(buffer, chunk_counts, chunks)
    flat = buffer.view(-1).view(torch.uint8)
    flat[index] = header.view(torch.uint8).unsqueeze(0).expand_as(index)


def read_chunk_headers(
    buffer: torch.Tensor,  # [S, H] contiguous
    chunk_counts: torch.Tensor,  # [W] token rows per chunk
    chunks: ChunkLayout,
) -> torch.Tensor:
    """``[W, HEADER_INTS]`` int32: the header at the start of each chunk."""
    index = _header_bytes_index(buffer, chunk_counts, chunks)
    return buffer.view(-1).view(torch.uint8)[index].view(torch.int32)


def record_headers(
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
