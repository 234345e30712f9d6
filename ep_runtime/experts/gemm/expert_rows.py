"""The STANDARD layout's row bookkeeping around the expert GEMMs (``expert_gemm.py``):
its torch spec and its Triton kernels.

* ``sort_pairs``: the served (row, slot) pairs of ``topk_ids [R, K]`` as ``row·K + slot``,
  sorted by local expert, stable in (row, slot), with the group starts ``offsets [L + 1]``. Only
  indices move: the GEMMs read each pair's hidden state straight from the received rows.
* ``sum_slots``: ``out[r] = Σ_k y[r·K + k]`` over the served slots in slot order, in fp32,
  rounded once; a row with no served slot (padding, which may hold NaN) is exact zero and no
  ``y`` row of an unserved slot is read.

Both are deterministic (no atomics) and read nothing on the host.
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.triton_common import cdiv, kernel, pow2, tl
from ep_runtime.kernels.triton_common import rounded as _rounded

MAX_SORT_BLOCK = 16384  # pairs one program scans per step (each step waits on two reductions)
MAX_SUM_BLOCK = 1024  # elements of a row one program sums

# --------------------------------------------------------------------------- torch spec


def _served(topk_ids: torch.Tensor, local_offset: int, num_local: int) -> torch.Tensor:
    """``[R, K]`` local expert of each slot, ``num_local`` where the slot is not served here."""
    local = topk_ids.to(torch.int64) - local_offset
    return torch.where((local >= 0) & (local < num_local), local, num_local)


def sort_pairs_spec(
    topk_ids: torch.Tensor,  # [R, K] global ids, -1 (or another rank's) = not served
    *,
    local_offset: int,
    num_local: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pairs [R·K]`` int32 (served pairs by (expert, row, slot), then -1) and ``offsets``."""
    key = _served(topk_ids, local_offset, num_local).reshape(-1)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    served = key.index_select(0, order) < num_local
    pairs = torch.where(served, order, -1).to(torch.int32)
    return pairs, offsets


def sum_slots_spec(
    y: torch.Tensor,  # [R·K, H] per-pair results; rows of unserved slots undefined
    topk_ids: torch.Tensor,  # [R, K]
    *,
    local_offset: int,
    num_local: int,
) -> torch.Tensor:
    num_rows, top_k = topk_ids.shape
    served = _served(topk_ids, local_offset, num_local) < num_local
    per_slot = y.view(num_rows, top_k, -1)
    total = torch.zeros(num_rows, y.size(1), dtype=torch.float32, device=y.device)
    for k in range(top_k):
        total += torch.where(served[:, k : k + 1], per_slot[:, k].float(), 0.0)
    return total.to(y.dtype)


# --------------------------------------------------------------------------- Triton kernels


@kernel(do_not_specialize=["num_pairs"])
def _sort_kernel(
    ids,  # [R, K] int32/int64
    stride_r,
    stride_k,
    pairs,  # [R·K] int32 out: served pairs, grouped
    offsets,  # [L + 1] int32 out
    num_pairs,
    top_k,
    local_offset,
    num_local,
    BLOCK: tl.constexpr,
):
    """Program ``e``: counts the served pairs of experts < e and == e (its start and size), then
    places its own pairs in (row, slot) order."""
    e = tl.program_id(0)
    before = 0
    count = 0
    for start in range(0, num_pairs, BLOCK):
        q = start + tl.arange(0, BLOCK)
        ok = q < num_pairs
        local = tl.load(ids + (q // top_k) * stride_r + (q % top_k) * stride_k, mask=ok, other=-1)
        local = local.to(tl.int64) - local_offset
        served = ok & (local >= 0) & (local < num_local)
        before += tl.sum((served & (local < e)).to(tl.int32), 0)
        count += tl.sum((served & (local == e)).to(tl.int32), 0)
    tl.store(offsets + e, before)
    if e == num_local - 1:
        tl.store(offsets + num_local, before + count)
    running = before
    for start in range(0, num_pairs, BLOCK):
        q = start + tl.arange(0, BLOCK)
        ok = q < num_pairs
        local = tl.load(ids + (q // top_k) * stride_r + (q % top_k) * stride_k, mask=ok, other=-1)
        mine = ok & (local.to(tl.int64) - local_offset == e)
        rank = running + tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(pairs + rank, q.to(tl.int32), mask=mine)
        running += tl.sum(mine.to(tl.int32), 0)


@kernel
def _sum_kernel(
    y,  # [R·K, H]
    stride_y,
    ids,  # [R, K]
    stride_r,
    stride_k,
    out,  # [R, H]
    stride_o,
    top_k,
    hidden,
    local_offset,
    num_local,
    KP: tl.constexpr,  # K padded to a power of two: the slots' loads are in flight together
    BLOCK: tl.constexpr,
):
    """Program (row, block of H): slots added in order in fp32, one rounding."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < hidden
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(KP):
        if k < top_k:
            local = tl.load(ids + r * stride_r + k * stride_k).to(tl.int64) - local_offset
            served = (local >= 0) & (local < num_local)
            part = tl.load(y + (r * top_k + k) * stride_y + h, mask=ok & served, other=0.0)
            total += part.to(tl.float32)
    tl.store(out + r * stride_o + h, _rounded(total, out.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------- launchers


def sort_pairs(
    topk_ids: torch.Tensor,  # [R, K] (a strided view is fine)
    pairs: torch.Tensor,  # [≥ R·K] int32: entries < offsets[L] written
    offsets: torch.Tensor,  # [L + 1] int32: written
    *,
    local_offset: int,
    num_local: int,
) -> None:
    num_rows, top_k = topk_ids.shape
    # few steps: a prefill's 32K pairs in two (16 warps), a decode's in one (H200: T 4096,
    # 54.7 -> 39.3 us against 4096-pair steps with 8 warps; same result bits)
    block = max(1024, min(MAX_SORT_BLOCK, pow2(num_rows * top_k)))
    _sort_kernel[(num_local,)](
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        pairs,
        offsets,
        num_rows * top_k,
        max(top_k, 1),
        local_offset,
        num_local,
        BLOCK=block,
        num_warps=16 if block >= 8192 else 8 if block >= 4096 else 4,
    )


def sum_slots(
    y: torch.Tensor,  # [R·K, H]
    topk_ids: torch.Tensor,  # [R, K]
    out: torch.Tensor,  # [R, H]: every row written
    *,
    local_offset: int,
    num_local: int,
) -> torch.Tensor:
    num_rows, top_k = topk_ids.shape
    hidden = out.size(1)
    if num_rows == 0 or hidden == 0:
        return out
    block = min(pow2(hidden), MAX_SUM_BLOCK)
    _sum_kernel[(num_rows, cdiv(hidden, block))](
        y,
        y.stride(0),
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        out,
        out.stride(0),
        top_k,
        hidden,
        local_offset,
        num_local,
        KP=pow2(top_k),
        BLOCK=block,
        num_warps=max(1, min(8, block * out.element_size() // 512)),
    )
    return out
