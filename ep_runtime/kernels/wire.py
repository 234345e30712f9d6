"""The forward protocol's wire format: the header every dispatch and combine carries, and the
control block a dispatcher keeps on its device. ``dispatch/protocol.py`` is what interprets them;
the ops here only write (route), copy (pack, chunk headers) or check (record) them on the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

HEADER_INTS = 16  # int32 fields of a forward header; 64 bytes
HEADER_BYTES = 4 * HEADER_INTS


class Field(enum.IntEnum):
    """Columns of a forward header (one ``[HEADER_INTS]`` int32 row per (source, destination))."""

    STATUS = 0  # ForwardStatus of the source
    SEQ = 1  # the source's forward counter (per dispatcher)
    FINGERPRINT = 2  # hash of the layer's settings, agreed when it was built
    LAYER = 3  # index of the layer on its dispatcher
    PHASE = 4  # Phase: which collective of the forward this is
    TOP_K = 5  # K in force at the source (0: a rank with no tokens agrees with any K)
    NUM_CHUNKS = 6  # exact mode: rounds the source needs for its tokens
    NUM_ROWS = 7  # token rows the source sends to this destination
    NUM_SLOTS = 8  # (token, slot) pairs among those rows that this destination serves


@dataclass(frozen=True)
class HeaderFields:
    """The protocol's part of a dispatch header; the route adds the per-destination counts."""

    status: int
    fingerprint: int
    layer: int
    phase: int
    top_k: int
    num_chunks: int


class Control(enum.IntEnum):
    """Entries of a dispatcher's control block: an int32 tensor on its device, updated by the
    data-path ops without a host sync (so capacity mode stays capturable in a CUDA graph)."""

    SEQ = 0  # the next forward's number
    BAD_IDS = 1  # ids dropped since the last check (out of range, or repeated in a row)
    FAILED_STATUS = 2  # worst ForwardStatus recorded since the last check, 0 = none
    FAILED_RANK = 3  # the first rank that recorded it
    FAILED_SEQ = 4  # that rank's forward number
    FORWARD_FAILED = 5  # 1 while the current forward has seen a failure
    ROUTE_TICKET = 6  # the route's next block (0 between launches)
    ROUTE_DONE = 7  # the route's programs finished (0 between launches)


CONTROL_INTS = 8


def new_control(device: torch.device) -> torch.Tensor:
    return torch.zeros(CONTROL_INTS, dtype=torch.int32, device=device)
