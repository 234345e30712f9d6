"""``local_ids``: a received row's ids with the ones this rank does not serve made -1 (the
encoding is ``placement.LocalExperts``).

The torch function is the spec (and the CPU path); the Triton one is bitwise equal to it and
reads no device value on the host.
"""

from __future__ import annotations

import torch

from ep_runtime.kernels.triton_common import TILE_ELEMENTS, cdiv, kernel, pow2, tl
from ep_runtime.placement import LocalExperts


def torch_local_ids(
    topk_ids: torch.Tensor,  # [R, K] int32 global ids (a strided view is fine)
    *,
    local_offset: int,
    num_local: int,
) -> torch.Tensor:
    """``[R, K]`` int32: the ids this rank serves, -1 elsewhere."""
    return LocalExperts(local_offset, num_local).own(topk_ids)


# --------------------------------------------------------------------------- Triton
@kernel
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


def triton_local_ids(
    topk_ids: torch.Tensor,  # [R, K] int32 global ids (a strided view is fine)
    *,
    local_offset: int,
    num_local: int,
) -> torch.Tensor:
    """``[R, K]`` int32: the ids this rank serves, -1 elsewhere (one launch)."""
    num_rows, top_k = topk_ids.shape
    out = torch.empty(num_rows, top_k, dtype=torch.int32, device=topk_ids.device)
    kp = pow2(top_k)
    block = max(1, min(256, TILE_ELEMENTS // kp))
    if num_rows:
        _local_ids_kernel[(cdiv(num_rows, block),)](
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
