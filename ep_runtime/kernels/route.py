"""``route_tokens``: where each of this rank's tokens goes, and the header to each rank.

The route also writes the forward header (the protocol's fields plus per-destination counts),
advances the forward counter in the control block and, when given a ``slot_load``, counts each
kept (token, slot) pair in its slot's bin (the layer's expert load, for EPLB): all in the same
launch, so capacity mode needs no host sync and no second kernel per forward.

The torch function is the spec (and the CPU path); the Triton one is bitwise equal to it and
reads no device value on the host.
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.triton_common import (
    C_BAD_IDS,
    C_FORWARD_FAILED,
    C_ROUTE_DONE,
    C_ROUTE_TICKET,
    C_SEQ,
    F_FINGERPRINT,
    F_LAYER,
    F_NUM_CHUNKS,
    F_NUM_ROWS,
    F_NUM_SLOTS,
    F_PHASE,
    F_SEQ,
    F_STATUS,
    F_TOP_K,
    HINTS,
    TILE_ELEMENTS,
    cdiv,
    jit,
    kernel,
    pow2,
    tl,
)
from ep_runtime.kernels.types import Route
from ep_runtime.kernels.wire import Control, Field, HeaderFields


def torch_route_tokens(
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
    slot_load: torch.Tensor | None = None,  # [E] int64: += kept (token, slot) pairs per id
    scratch: torch.Tensor | None = None,  # the Triton route's work space; not needed here
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
    if slot_load is not None:  # a fixed-shape add (unused pairs add 0): graph-capturable
        kept = ids >= 0
        slot_load.index_add_(0, ids.clamp(min=0).reshape(-1), kept.reshape(-1).to(torch.int64))
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


# --------------------------------------------------------------------------- Triton
MAX_PROGRAMS = 128  # the route's programs at most (its look-back words are sized for them)


def new_route_scratch(device: torch.device, world_size: int) -> torch.Tensor:
    """The multi-program route's work space, zeroed once and kept by its caller across
    launches: ``[2·WP + 1]`` totals (rows and slots per destination, dropped ids: summed by
    the programs, read and cleared by the last), then ``[MAX_PROGRAMS, WP]`` look-back words.
    A word carries the forward's number, so a launch needs no zeroing of its own."""
    wp = pow2(world_size)
    return torch.zeros(2 * wp + 1 + MAX_PROGRAMS * wp, dtype=torch.int64, device=device)


@jit
def _block_routes(
    topk_ids,
    ids_stride_t,
    ids_stride_k,
    t,  # [BT] token indices
    num_tokens,
    num_experts,
    experts_per_rank,
    top_k,
    world,
    KP: tl.constexpr,
    WP: tl.constexpr,
    DROP: tl.constexpr,
):
    """One block of tokens: ids ``[BT, KP]`` int32 (invalid ones dropped to -1), which of those
    entries exist (``[BT, KP]``: token < ``num_tokens``, slot < ``top_k``), the hits
    ``[BT, KP, WP]`` int32 (slot k goes to rank w) and the ids dropped per token."""
    k = tl.arange(0, KP)
    w = tl.arange(0, WP)
    t_ok = t < num_tokens
    tk_ok = t_ok[:, None] & (k[None, :] < top_k)  # [BT, KP]
    ids = tl.load(
        topk_ids + t.to(tl.int64)[:, None] * ids_stride_t + k[None, :] * ids_stride_k,
        mask=tk_ok,
        other=-1,
    ).to(tl.int64)
    dropped = tl.zeros_like(t)
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
        dropped = tl.sum((out_of_range | repeated).to(tl.int32), axis=1)
    owner = tl.where(ids >= 0, tl.where(ids >= 0, ids, 0) // experts_per_rank, -1)
    hit = (owner[:, :, None] == w[None, None, :]) & (w[None, None, :] < world)  # [BT,KP,WP]
    return ids, tk_ok, hit.to(tl.int32), dropped


@jit
def _look_back(scratch, program, epoch, count, WP: tl.constexpr, world):
    """Rows per destination of the blocks before ``program`` (a decoupled look-back): its own
    ``count`` published first, then the earlier blocks' words read back until one holds a running
    total; its own running total published last. Programs take their blocks in ticket order, so
    every block waited on belongs to a program already running."""
    # a word: the forward's epoch (bits 32-62), state (bits 30-31: 1 = the block's own rows,
    # 2 = the rows of every block up to it), rows (bits 0-29)
    w = tl.arange(0, WP)
    lanes = w < world
    words = scratch + 2 * WP + 1
    stamp = epoch << 32
    tl.atomic_xchg(words + program * WP + w, stamp | (1 << 30) | count, mask=lanes)
    before = tl.zeros([WP], dtype=tl.int64)
    pending = lanes
    j = program - 1
    while (j >= 0) & (tl.max(pending.to(tl.int32), axis=0) > 0):
        got = tl.atomic_add(words + j * WP + w, 0, mask=lanes, sem="acquire")
        ready = ((got >> 32) == epoch) | ~lanes
        all_ready = tl.min(ready.to(tl.int32), axis=0) > 0
        take = pending & all_ready
        before += tl.where(take, got & 0x3FFFFFFF, 0)
        pending = pending & ~(take & (((got >> 30) & 3) == 2))
        j = tl.where(all_ready, j - 1, j)
    total = before + count
    tl.atomic_xchg(words + program * WP + w, stamp | (2 << 30) | total, mask=lanes)
    return before


@jit
def _finish(
    header,
    header_stride,
    control,
    rows,  # [WP] token rows per destination (all tokens)
    slots,  # [WP] (token, slot) pairs per destination
    dropped,
    seq,
    bad_ids,
    status,
    fingerprint,
    layer,
    phase,
    top_k_field,
    num_chunks,
    invalid_status,
    world,
    WP: tl.constexpr,
    DROP: tl.constexpr,
):
    """The header to each rank, and the control block's forward counter and ids count."""
    w = tl.arange(0, WP)
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
    values = tl.where(f == F_NUM_ROWS, rows.to(tl.int32)[:, None], values)
    values = tl.where(f == F_NUM_SLOTS, slots.to(tl.int32)[:, None], values)
    tl.store(header + w[:, None] * header_stride + f, values, mask=w[:, None] < world)
    tl.store(control + C_SEQ, seq + 1)
    tl.store(control + C_FORWARD_FAILED, 0)
    if DROP:
        tl.store(control + C_BAD_IDS, bad_ids + tl.where(invalid_status == 0, dropped, 0))


@kernel
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
    scratch,  # int64 (new_route_scratch; not read by one program)
    slot_load,  # [E] int64 (COUNT)
    num_tokens,
    tokens_per_program,  # a multiple of BT
    num_programs,
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
    COUNT: tl.constexpr,  # add each kept (token, slot) pair to slot_load
    EB: tl.constexpr,  # load bins: the E slots and one for unused pairs, a power of two
    ONE: tl.constexpr,  # one program walks all tokens (no look-back, no totals in scratch)
):
    """Each program takes (by ticket) the next ``tokens_per_program`` tokens, in steps of BT:
    it counts its rows per destination, learns those of the blocks before it (``_look_back``),
    then writes its tokens' ids, row slots and ``token_of`` entries. The last program to finish
    writes the header from the totals and advances the control block."""
    if ONE:  # noqa: SIM108 (a constexpr branch: the atomic is not compiled for one program)
        program = 0
    else:
        program = tl.atomic_add(control + C_ROUTE_TICKET, 1)
    seq = tl.load(control + C_SEQ)
    bad_ids = tl.load(control + C_BAD_IDS)
    tl.debug_barrier()  # every thread has read control before any thread writes it
    w = tl.arange(0, WP)
    lanes = w < world
    first = program * tokens_per_program
    last = tl.minimum(first + tokens_per_program, num_tokens)
    rows = tl.zeros([WP], dtype=tl.int64)  # rows of earlier blocks, then of this one so far
    own = tl.zeros([WP], dtype=tl.int64)  # this program's rows per destination (not ONE)
    if not ONE:
        for start in range(first, last, BT):
            t = start + tl.arange(0, BT)
            _, _, hit, _ = _block_routes(
                topk_ids, ids_stride_t, ids_stride_k, t, last, num_experts,
                experts_per_rank, top_k, world, KP, WP, DROP,
            )  # fmt: skip
            own += tl.sum((tl.max(hit, axis=1) > 0).to(tl.int64), axis=0)
            past = (t[:, None] < last) & lanes[None, :]  # -1 first: real entries land later
            tl.store(token_of + w[None, :].to(tl.int64) * num_tokens + t[:, None], -1, mask=past)
        epoch = (seq.to(tl.int64) & 0x7FFFFFFF) + 1
        # barriers: every thread's -1 fill before the word that lets later blocks write over
        # it, and every thread's writes below after the words read (a release or acquire
        # orders only the accesses its own thread has seen)
        tl.debug_barrier()
        rows = _look_back(scratch, program, epoch, own, WP, world)
        tl.debug_barrier()
    slot_lanes = tl.zeros([BT, WP], dtype=tl.int32)  # (token, slot) pairs per lane, summed last
    dropped_lanes = tl.zeros([BT], dtype=tl.int32)
    load = tl.zeros([EB], dtype=tl.int32)  # kept (token, slot) pairs per slot (COUNT)
    k = tl.arange(0, KP)
    for start in range(first, last, BT):
        t = start + tl.arange(0, BT)
        ids, tk_ok, hit, dropped = _block_routes(
            topk_ids, ids_stride_t, ids_stride_k, t, last, num_experts,
            experts_per_rank, top_k, world, KP, WP, DROP,
        )  # fmt: skip
        dropped_lanes += dropped
        t64 = t.to(tl.int64)
        tl.store(ids_out + t64[:, None] * top_k + k[None, :], ids, mask=tk_ok)
        if COUNT:  # unused pairs fall in the bin past the slots
            bins = tl.where(tk_ok & (ids >= 0), ids, num_experts)
            load += tl.histogram(tl.reshape(bins, [BT * KP]), EB)
        slot_lanes += tl.sum(hit, axis=1)
        member = tl.max(hit, axis=1) > 0  # [BT, WP]: token t goes to rank w
        running = tl.cumsum(member.to(tl.int64), axis=0) + rows[None, :]  # [BT, WP]
        slot = tl.where(member, running - 1, -1).to(tl.int32)
        tl.store(
            dest_slot + t64[:, None] * world + w[None, :],
            slot,
            mask=(t[:, None] < last) & lanes[None, :],
        )
        token_rows = w[None, :].to(tl.int64) * num_tokens  # [1, WP]
        tl.store(token_of + token_rows + slot, t[:, None] + 0 * slot, mask=member)
        rows += tl.sum(member.to(tl.int64), axis=0)
    slots = tl.sum(slot_lanes, axis=0).to(tl.int64)  # [WP]
    dropped = tl.sum(dropped_lanes, axis=0)
    if COUNT:
        e = tl.arange(0, EB)
        tl.atomic_add(slot_load + e, load.to(tl.int64), mask=e < num_experts)
    if ONE:
        for start in range(0, num_tokens, BT):  # token_of past each destination's count
            s = start + tl.arange(0, BT)
            past = (s[:, None] < num_tokens) & (s[:, None] >= rows[None, :]) & lanes[None, :]
            tl.store(token_of + w[None, :].to(tl.int64) * num_tokens + s[:, None], -1, mask=past)
        _finish(
            header, header_stride, control, rows, slots, dropped, seq, bad_ids, status,
            fingerprint, layer, phase, top_k_field, num_chunks, invalid_status, world, WP, DROP,
        )  # fmt: skip
    else:
        tl.atomic_add(scratch + w, own, mask=lanes)
        tl.atomic_add(scratch + WP + w, slots, mask=lanes)
        tl.atomic_add(scratch + 2 * WP, dropped.to(tl.int64))
        tl.debug_barrier()  # this program's totals added before it counts itself done
        if tl.atomic_add(control + C_ROUTE_DONE, 1) == num_programs - 1:  # the last one
            rows = tl.atomic_xchg(scratch + w, 0, mask=lanes)
            slots = tl.atomic_xchg(scratch + WP + w, 0, mask=lanes)
            dropped = tl.atomic_xchg(scratch + 2 * WP, 0).to(tl.int32)
            tl.store(control + C_ROUTE_TICKET, 0)
            tl.store(control + C_ROUTE_DONE, 0)
            _finish(
                header, header_stride, control, rows, slots, dropped, seq, bad_ids, status,
                fingerprint, layer, phase, top_k_field, num_chunks, invalid_status, world, WP,
                DROP,
            )  # fmt: skip


def triton_route_tokens(
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
    slot_load: torch.Tensor | None = None,  # [E] int64: += kept (token, slot) pairs per id
    scratch: torch.Tensor | None = None,  # new_route_scratch(device, W), kept across calls
) -> Route:
    """Destinations and chunk rows of every token, and the header to each rank (one launch;
    ``torch_route_tokens`` is the spec). Without ``scratch`` a call makes its own."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    dest_slot = torch.empty(num_tokens, world_size, dtype=torch.int32, device=device)
    token_of = torch.empty(world_size, num_tokens, dtype=torch.int32, device=device)
    kp, wp = pow2(top_k), pow2(world_size)
    block = pow2(max(8, min(256, 2 * TILE_ELEMENTS // (kp * max(kp, wp)), pow2(num_tokens))))
    programs = min(MAX_PROGRAMS, max(1, cdiv(num_tokens, block)))
    per_program = max(1, cdiv(cdiv(num_tokens, programs), block)) * block
    programs = max(1, cdiv(num_tokens, per_program))
    if scratch is None and programs > 1:
        scratch = new_route_scratch(device, world_size)
    _route_kernel[(programs,)](
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        ids,
        dest_slot,
        token_of,
        header_out,
        header_out.stride(0),
        control,
        control if scratch is None else scratch,  # not read by one program
        control if slot_load is None else slot_load,  # not read without COUNT
        num_tokens,
        per_program,
        programs,
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
        BT=block,
        DROP=drop_invalid,
        COUNT=slot_load is not None,
        EB=pow2(num_experts + 1),
        ONE=programs == 1,
        num_warps=8,
    )
    return Route(ids, dest_slot, token_of, header_out)
