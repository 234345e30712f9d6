"""What the data-path ops hand back: a route, and rows grouped by local expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
