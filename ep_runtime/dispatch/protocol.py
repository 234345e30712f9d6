"""The forward protocol every dispatcher runs: numbered forwards, checked headers, and failures
carried to every rank.

A forward is three collectives in a fixed order: a fixed-size header all-to-all, the dispatch
data, and the combine data with a status per peer. Each header names the source's status, its
forward number, the layer's fingerprint and index, and the phase, so a skipped or repeated
forward, layers called in different orders, or a combine meeting a dispatch are detected instead
of decoded as data. A rank that fails before dispatch says so in the header; one that fails in
the experts says so in the combine status; either way every rank raises, naming it.

Where reading the headers on the host is free (CPU, or exact mode, which syncs anyway) every rank
checks them at once and all raise together (the group stays in step). Capacity mode on CUDA never
syncs: the checks run on the device, a failed forward's output is NaN on every rank, and
``check()`` raises with the rank and the reason.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ep_runtime.dispatch.peers import Peers
from ep_runtime.kernels import record_headers
from ep_runtime.kernels.layout import HEADER_INTS, Control, Field, new_control
from ep_runtime.kernels.torch_ops import HeaderFields
from ep_runtime.types import EPInputError, ForwardMismatchError, RemoteRankError


class ForwardStatus(enum.IntEnum):
    """A rank's status in a forward header; nonzero is a failure."""

    OK = 0
    INPUT_ERROR = 1
    INTERNAL_ERROR = 2
    INTERRUPTED = 3
    MISMATCH = 4  # recorded on the device: the headers did not match (see Field)

    @staticmethod
    def of(error: BaseException | None) -> ForwardStatus:
        if error is None:
            return ForwardStatus.OK
        if isinstance(error, ValueError):
            return ForwardStatus.INPUT_ERROR
        if isinstance(error, KeyboardInterrupt):
            return ForwardStatus.INTERRUPTED
        return ForwardStatus.INTERNAL_ERROR


class Phase(enum.IntEnum):
    DISPATCH = 1
    COMBINE = 2


def fingerprint_of(settings: dict[str, object]) -> int:
    """A 31-bit hash of a layer's settings (stable across processes, unlike ``hash``)."""
    text = ";".join(f"{key}={settings[key]}" for key in sorted(settings))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass
class Outcome:
    """What a header check found: the error every rank raises (after the collectives of the
    phase are done), the forward's chunk count, or (device mode) the failure flag."""

    error: BaseException | None = None
    num_chunks: int = 1
    failed: torch.Tensor | None = None  # 0-d int32 on the device: nonzero = this forward failed
    sent: list[list[int]] | None = None  # [W][HEADER_INTS] headers sent, where read on the host
    received: list[list[int]] | None = None  # [W][HEADER_INTS] headers received, likewise

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class ForwardProtocol:
    """Forward numbering and header checks for one dispatcher (shared by its layers)."""

    def __init__(self, peers: Peers, device: torch.device, *, checks_on_device: bool) -> None:
        self.peers = peers
        self.rank = peers.comm.rank
        self.world_size = peers.comm.world_size
        self.checks_on_device = checks_on_device
        self.control = new_control(device)  # [CONTROL_INTS] int32
        # invalid ids: where headers are read on the host, they fail the forward through the
        # header's status (every rank raises); on the device they are dropped and counted
        self.invalid_ids_status = 0 if checks_on_device else int(ForwardStatus.INPUT_ERROR)
        self._combine_headers: dict[tuple[int, int, int], torch.Tensor] = {}

    def dispatch_fields(
        self, status: ForwardStatus, fingerprint: int, layer: int, top_k: int, num_chunks: int
    ) -> HeaderFields:
        return HeaderFields(int(status), fingerprint, layer, int(Phase.DISPATCH), top_k, num_chunks)

    def combine_header(self, status: ForwardStatus, fingerprint: int, layer: int) -> torch.Tensor:
        """``[HEADER_INTS]`` int32 on the device (cached: no kernel per forward)."""
        key = (int(status), fingerprint, layer)
        header = self._combine_headers.get(key)
        if header is None:
            values = [0] * HEADER_INTS
            values[Field.STATUS] = int(status)
            values[Field.FINGERPRINT] = fingerprint
            values[Field.LAYER] = layer
            values[Field.PHASE] = int(Phase.COMBINE)
            header = torch.tensor(values, dtype=torch.int32, device=self.control.device)
            self._combine_headers[key] = header
        return header

    # ----------------------------------------------------------------- checks
    def check(
        self,
        header_pair: torch.Tensor | None,  # [2, W, HEADER_INTS]: sent and received (dispatch)
        received: torch.Tensor,  # [W, HEADER_INTS] int32: the header from each rank
        phase: Phase,
        own_error: BaseException | None,
        top_k: int,  # this rank's K (0: no tokens); ignored for the combine
        explain: Callable[[], BaseException] | None = None,
        num_chunks: int = 1,  # this rank's chunk count (dispatch)
    ) -> Outcome:
        """Check the headers of one phase; every rank reaches the same verdict. Where headers
        are read on the host, the outcome carries them (exact mode sizes its buffers from them).
        ``explain``: this rank's error when its own header says its input was bad (the route
        found invalid ids on the device)."""
        if self.checks_on_device:
            if self.world_size > 1:
                record_headers(
                    received,
                    self.control,
                    rank=self.rank,
                    phase=int(phase),
                    top_k=top_k,
                    mismatch_status=int(ForwardStatus.MISMATCH),
                )
            return Outcome(error=own_error, failed=self.control[Control.FORWARD_FAILED])
        if self.world_size == 1:  # no peers to agree with; the route's verdict: own_status_error
            return Outcome(error=own_error, num_chunks=num_chunks)
        if header_pair is not None:
            sent, headers = self.peers.to_host(header_pair)
        else:
            sent, headers = None, self.peers.to_host(received)
        statuses = [row[Field.STATUS] for row in headers]
        if own_error is None and statuses[self.rank] and explain is not None:
            own_error = explain()
        if any(statuses):
            return Outcome(error=self._failure(statuses, own_error))
        mismatch = self._mismatch(headers, phase)
        if mismatch is not None:
            self.control[Control.SEQ] = max(row[Field.SEQ] for row in headers) + 1
            return Outcome(error=mismatch)
        if phase is Phase.COMBINE:
            return Outcome()
        ks = [row[Field.TOP_K] for row in headers]
        if len({k for k in (*ks, top_k) if k}) > 1:
            error = EPInputError(
                "topk_ids", "the same K on every rank in one forward", f"K per rank {ks}"
            )
            return Outcome(error=error)
        chunks = max(row[Field.NUM_CHUNKS] for row in headers)
        return Outcome(num_chunks=chunks, sent=sent, received=headers)

    def own_status_error(
        self, sent_header: torch.Tensor, explain: Callable[[], BaseException]
    ) -> BaseException | None:
        """A world of one reads nothing mid-forward: the status the route gave this rank's
        header (bad ids) is read once, at the end of the forward (one host sync)."""
        if self.checks_on_device or not int(sent_header[Field.STATUS]):
            return None
        return explain()

    def _failure(self, statuses: list[int], own_error: BaseException | None) -> BaseException:
        """Every rank gathers the failures' messages (one more collective, on this path only);
        the failing rank raises its own error, the others a ``RemoteRankError`` naming it."""
        message = None if own_error is None else f"{type(own_error).__name__}: {own_error}"
        messages = self.peers.all_gather_object(message)
        if own_error is not None:
            return own_error
        failed = next(rank for rank, status in enumerate(statuses) if status)
        reason = messages[failed] or ForwardStatus(statuses[failed]).name
        return RemoteRankError(failed, str(reason))

    def _mismatch(self, headers: list[list[int]], phase: Phase) -> ForwardMismatchError | None:
        own = headers[self.rank]
        differing = {}
        for rank, row in enumerate(headers):
            if row[Field.PHASE] != int(phase):
                differing[rank] = f"is in {Phase(row[Field.PHASE]).name.lower()}"
            elif row[Field.SEQ] != own[Field.SEQ] and phase is Phase.DISPATCH:
                differing[rank] = f"is at forward #{row[Field.SEQ]}"
            elif (row[Field.FINGERPRINT], row[Field.LAYER]) != (
                own[Field.FINGERPRINT],
                own[Field.LAYER],
            ):
                differing[rank] = (
                    f"runs layer {row[Field.LAYER]} (settings {row[Field.FINGERPRINT]:#x})"
                )
        if not differing:
            return None
        here = (
            f"rank {self.rank} is in {phase.name.lower()} of forward #{own[Field.SEQ]} "
            f"of layer {own[Field.LAYER]} (settings {own[Field.FINGERPRINT]:#x})"
        )
        return ForwardMismatchError(differing, here)

    def take_recorded(self) -> Recorded:
        """What the device recorded since the last call (one host read); clears it."""
        values = self.control.tolist()
        recorded = Recorded(
            status=ForwardStatus(values[Control.FAILED_STATUS]),
            rank=values[Control.FAILED_RANK],
            seq=values[Control.FAILED_SEQ],
            bad_ids=values[Control.BAD_IDS],
        )
        if recorded.status or recorded.bad_ids:
            self.control[Control.FAILED_STATUS : Control.FAILED_STATUS + 1] = 0
            self.control[Control.BAD_IDS : Control.BAD_IDS + 1] = 0
        return recorded


@dataclass(frozen=True)
class Recorded:
    """Failures recorded on the device (capacity mode): a peer's, and ids this rank dropped."""

    status: ForwardStatus
    rank: int
    seq: int
    bad_ids: int

    def raise_peer_failure(self) -> None:
        if self.status:
            reason = f"{self.status.name} in forward #{self.seq} (recorded on the device)"
            raise RemoteRankError(self.rank, reason)
