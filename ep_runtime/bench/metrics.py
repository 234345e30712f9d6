"""What a forward moves and computes, from the routing alone (no backend involved), and the
peak memory a rank used.

Wire rows: a token travels once to each rank owning at least one of its experts
(docs/architecture.md, "Wire format"), so a rank receives one row per (source token, this rank)
pair, its own tokens included, as one packed row of ``kernels/layout.py``'s ``RowFormat``
(``hidden | ids | weights``; with fp8 dispatch ``e4m3 hidden | fp32 scales | ids | weights``);
combine sends the results back in the compute dtype.
Expert work: one (token, expert) pair per valid slot.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

from ep_runtime.kernels.layout import RowFormat


def destination_rows(topk_ids: torch.Tensor, num_experts: int, world_size: int) -> list[int]:
    """``[W]``: how many of this rank's tokens go to each rank (≥ 1 of their experts there)."""
    ids = topk_ids.to(torch.int64)
    valid = ids >= 0
    owner = torch.where(valid, ids // (num_experts // world_size), 0)  # [T, K]
    reaches = torch.zeros(ids.size(0), world_size, dtype=torch.bool, device=ids.device)
    reaches.scatter_(1, owner, valid)  # -1 slots scatter False, reaching nobody
    return reaches.sum(0).tolist()


def expert_token_counts(topk_ids: torch.Tensor, num_experts: int) -> list[int]:
    """``[E]``: valid (token, expert) pairs per expert among this rank's tokens."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    return torch.bincount(ids[ids >= 0], minlength=num_experts).tolist()


def imbalance(loads: list[int]) -> float:
    """max / mean (1.0 = perfectly even); 1.0 when nothing was routed."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def expert_flops_per_pair(hidden: int, intermediate: int, gated: bool) -> int:
    """Multiply-adds × 2 of ``w2 · act(w13 · x)`` for one row: ``2H·(2I|I) + 2I·H``."""
    w13_rows = 2 * intermediate if gated else intermediate
    return 2 * hidden * w13_rows + 2 * intermediate * hidden


def dispatch_row_bytes(hidden: int, dtype: torch.dtype, max_top_k: int, quantized: bool) -> int:
    """Bytes of one dispatched token row on the row transport (``RowFormat.row_bytes``)."""
    return RowFormat(hidden, dtype, max_top_k, quantized=quantized).row_bytes


@dataclass(frozen=True)
class Traffic:
    """Rows between ranks: ``rows[s][d]`` = tokens of rank s sent to rank d (one row each)."""

    rows: list[list[int]]
    row_bytes: int  # one dispatch row (dispatch_row_bytes: hidden or q(x), ids, weights)
    combine_row_bytes: int | None = None  # one combine row (H · itemsize); None: row_bytes

    @classmethod
    def of_layer(
        cls, rows: list[list[int]], hidden: int, dtype: torch.dtype, max_top_k: int, fp8: bool
    ) -> Traffic:
        """The rows of a layer whose dispatch sends fp8 rows when ``fp8`` (combine: dtype)."""
        row_bytes = dispatch_row_bytes(hidden, dtype, max_top_k, quantized=fp8)
        return cls(rows, row_bytes, combine_row_bytes=hidden * dtype.itemsize)

    def received_rows(self, rank: int) -> int:
        return sum(source[rank] for source in self.rows)

    def dispatch_received_bytes(self, rank: int) -> int:
        """Dispatch: bytes rank receives, its own tokens included (DeepEP's definition)."""
        return self.received_rows(rank) * self.row_bytes

    def combine_bytes(self, rank: int) -> int:
        """Combine: the same rows go back (DeepEP's definition), each ``combine_row_bytes``."""
        per_row = self.row_bytes if self.combine_row_bytes is None else self.combine_row_bytes
        return self.received_rows(rank) * per_row


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
