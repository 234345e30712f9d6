"""STANDARD ↔ EXPANDED row layouts without a host sync (static sizes, stable sort, scatter).

EXPANDED puts one row per (row, local slot), grouped by local expert. Used by the dispatchers
(the receiver expands) and by experts that want grouped rows but are handed STANDARD ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Expansion:
    """Where each (row, slot) of a ``[R, K]`` STANDARD table went in ``num_rows`` grouped rows."""

    source_row: torch.Tensor  # [N] int64: STANDARD row each grouped row copies
    source_slot: torch.Tensor  # [N] int64: slot of that row
    valid: torch.Tensor  # [N] bool: row holds a (row, slot) pair; False = padding at the end
    slot_position: torch.Tensor  # [R, K] int64 grouped row of each pair, N = not served here
    expert_num_tokens: torch.Tensor  # [L] int32
    expert_offsets: torch.Tensor  # [L + 1] int32, group starts; offsets[L] = valid rows
    num_rows: int


def count_per_expert(local_index: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """``[L]`` int64 count of (row, slot) pairs per local expert; index ``L`` = not served."""
    flat = local_index.reshape(-1)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts[:num_local_experts]


def plan_expansion(local_index: torch.Tensor, num_local_experts: int, num_rows: int) -> Expansion:
    """``local_index [R, K]`` holds the local expert in ``[0, L)`` per slot, ``L`` = not served.

    ``num_rows`` is the grouped row count: exact (from host counts) or a static upper bound
    (``R · min(K, L)``); rows past the valid count are padding. No host sync.
    """
    num_src_rows, top_k = local_index.shape
    device = local_index.device
    flat = local_index.reshape(-1)
    counts = count_per_expert(local_index, num_local_experts)
    order = torch.sort(flat, stable=True).indices  # served pairs first, grouped by expert
    kept = order[:num_rows]
    if kept.numel() < num_rows:  # only when num_rows > R·K: pad with pair 0 (masked invalid)
        kept = torch.cat([kept, kept.new_zeros(num_rows - kept.numel())])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    served = flat < num_local_experts
    slot_position = torch.where(served, inverse, torch.full_like(inverse, num_rows))
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    # clamped: malformed input (a repeated id) can never point a GEMM past num_rows
    offsets[1:] = counts.cumsum(0).clamp(max=num_rows)
    valid = torch.arange(num_rows, device=device) < offsets[-1]
    return Expansion(
        source_row=kept // max(top_k, 1),
        source_slot=kept % max(top_k, 1),
        valid=valid,
        slot_position=slot_position.view(num_src_rows, top_k),
        expert_num_tokens=counts.to(torch.int32),
        expert_offsets=offsets.to(torch.int32),
        num_rows=num_rows,
    )


def sum_rows_fp32(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``out[i] = Σ_j rows[positions[i, j]]`` in fp32; position ``len(rows)`` means "nothing".

    One gather, one mask and one fp32 reduction (``torch.sum`` with ``dtype``): deterministic, no
    atomics, and an unreferenced row (padding may hold NaN) never reaches the sum.
    """
    num_out, width = positions.shape
    num_rows, hidden = rows.shape
    if num_rows == 0:
        return torch.zeros(num_out, hidden, dtype=torch.float32, device=rows.device)
    unused = positions >= num_rows  # [N, J]
    gathered = rows.index_select(0, positions.clamp(max=num_rows - 1).reshape(-1))
    gathered = gathered.view(num_out, width, hidden).masked_fill_(unused.unsqueeze(-1), 0)
    return torch.sum(gathered, dim=1, dtype=torch.float32)
