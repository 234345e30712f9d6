"""What the FlashInfer experts backends share: the lazy import probe, the routing tuple handed to
the kernels, and intermediate-size padding. Nothing here imports flashinfer at module import time
(CPU users do not have it)."""

from __future__ import annotations

import functools

import torch

from ep_runtime.types import Dispatched

FLASHINFER_VERSION = "0.7.2.post1"  # the version these adapters were written and tested against


@functools.cache
def flashinfer_missing_reason() -> str | None:
    """Why ``import flashinfer`` fails here, or None. Cached: the import takes about a second."""
    try:
        import flashinfer  # noqa: F401
    except Exception as error:  # any import failure (missing deps, CUDA libs) is a refusal
        return (
            f"flashinfer is not importable ({type(error).__name__}: {error}); "
            f"install flashinfer-python=={FLASHINFER_VERSION} (the 'gpu' extra)"
        )
    return None


def kernel_routing(dispatched: Dispatched) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, weights)`` as the kernels take them: ``[R, K']`` contiguous int32 global ids
    (int32 is the dispatch contract, checked here, not cast) and ``[R, K']`` contiguous fp32
    weights with exact zeros on -1 slots.

    The kernels skip -1 slots today (TRTLLM finalize: ``permutedIdx == -1``; CUTLASS: ids out of
    the local range); zeroing their weights costs one elementwise op and keeps NaN out of the
    output whatever a kernel version does with them.
    """
    if dispatched.topk_ids.dtype != torch.int32:
        raise TypeError(
            f"Dispatched.topk_ids must be int32 (the dispatch contract), got "
            f"{dispatched.topk_ids.dtype}"
        )
    ids = dispatched.topk_ids.contiguous()
    weights = torch.where(ids >= 0, dispatched.topk_weights.float(), 0.0).contiguous()
    return ids, weights


def pad_intermediate(
    w13: torch.Tensor,  # [L, 2I, H] ([gate; up]) if gated, else [L, I, H]
    w2: torch.Tensor,  # [L, H, I]
    multiple: int,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Zero-pad the intermediate size to a multiple of ``multiple``: ``(w13, w2, padded I)``.

    Gated weights pad the gate and up halves separately (``[gate, 0; up, 0]``). A padded unit
    computes ``silu(0)·0 = 0`` or ``relu(0)² = 0`` and meets a zero column of ``w2``, so the
    result is unchanged.
    """
    num_local, _, hidden = w13.shape
    intermediate = w2.size(2)
    padded = -(-intermediate // multiple) * multiple
    if padded == intermediate:
        return w13, w2, intermediate
    halves = 2 if gated else 1
    w13_padded = w13.new_zeros(num_local, halves, padded, hidden)
    w13_padded[:, :, :intermediate] = w13.view(num_local, halves, intermediate, hidden)
    w2_padded = w2.new_zeros(num_local, hidden, padded)
    w2_padded[:, :, :intermediate] = w2
    return w13_padded.view(num_local, halves * padded, hidden), w2_padded, padded
