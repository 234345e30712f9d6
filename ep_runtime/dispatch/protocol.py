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

from ep_runtime.comm import Comm
from ep_runtime.kernels import KernelOps
from ep_runtime.kernels.route import new_route_scratch
from ep_runtime.kernels.wire import HEADER_INTS, Control, Field, HeaderFields, new_control
from ep_runtime.types import (
    EPInputError,
    ForwardMismatchError,
    GroupUnusableError,
    RemoteRankError,
)
from ep_runtime.validation import check_topk_id_values


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
    PLACEMENT = 3  # the first step of a placement change (eplb/transaction.py)


@dataclass(frozen=True)
class LayerIdentity:
    """Which layer a forward belongs to, carried in every header."""

    fingerprint: int  # of the layer's settings, agreed by all ranks at build
    index: int  # the layer's number on its dispatcher (same on every rank)


def fingerprint_of(settings: dict[str, object]) -> int:
    """A 31-bit hash of a layer's settings (stable across processes, unlike ``hash``)."""
    text = ";".join(f"{key}={settings[key]}" for key in sorted(settings))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class Checks:
    """How a dispatcher's forwards are checked; decided once (``DispatchSetup.checks``)."""

    on_device: bool  # capacity mode (or device_checks alone) on CUDA: raised by check()
    peers: bool  # other ranks take part (a world of one has no headers to agree on)
    exact: bool  # exact mode: buffers sized from the headers where they are read on the host


@dataclass(frozen=True)
class ExactSizes:
    """Per-peer counts read from the headers on the host (exact mode with peers)."""

    send_rows: list[int]  # [W] token rows this rank sends each peer
    recv_rows: list[int]  # [W] token rows each peer sends this rank
    served_slots: int  # (token, slot) pairs among the received rows that this rank serves


@dataclass(frozen=True)
class Agreed:
    """What the dispatch header exchange settled, as a transport uses it."""

    top_k: int  # the K of the ids that arrive: this rank's, or the highest any rank sent
    num_chunks: int  # rounds of this forward (exact mode: the most any rank needs)
    sent_rows: torch.Tensor  # [W] int32 on the device: token rows sent to each peer
    received_rows: torch.Tensor  # [W] int32 on the device: token rows from each peer
    sizes: ExactSizes | None  # None: static sizes (capacity mode, or nothing read on the host)
    failed: torch.Tensor | None  # device checks: 0-d int32, nonzero = this forward failed


@dataclass(frozen=True)
class Outcome:
    """A phase's verdict: the error every rank raises (after the phase's collectives), what
    the dispatch agreed, and an error only the end of the forward can tell (a world of one)."""

    error: BaseException | None = None
    agreed: Agreed | None = None  # dispatch: None when the forward failed (host checks)
    failed: torch.Tensor | None = None  # combine, device checks: as ``Agreed.failed``
    late_error: Callable[[], BaseException | None] | None = None

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class ForwardProtocol:
    """Forward numbering and header checks for one dispatcher (shared by its layers)."""

    def __init__(self, comm: Comm, ops: KernelOps, device: torch.device, checks: Checks) -> None:
        self.comm = comm
        self.ops = ops
        self.rank = comm.rank
        self.checks = checks
        self.control = new_control(device)  # [CONTROL_INTS] int32
        self.route_scratch = new_route_scratch(device, comm.world_size)  # the route's own
        # invalid ids: where headers are read on the host, they fail the forward through the
        # header's status (every rank raises); on the device they are dropped and counted
        self.invalid_ids_status = 0 if checks.on_device else int(ForwardStatus.INPUT_ERROR)
        self._combine_headers: dict[tuple[int, int, int], torch.Tensor] = {}

    def raise_if_alone(self, failure: BaseException) -> None:
        """A rank that failed before dispatch takes part so its peers learn it; alone, it
        raises at once."""
        if not self.checks.peers:
            raise failure

    def dispatch_fields(
        self, status: ForwardStatus, layer: LayerIdentity, top_k: int, num_chunks: int
    ) -> HeaderFields:
        phase = int(Phase.DISPATCH)
        return HeaderFields(int(status), layer.fingerprint, layer.index, phase, top_k, num_chunks)

    def status_to_carry(self, status: ForwardStatus, layer: LayerIdentity) -> torch.Tensor | None:
        """``[HEADER_INTS]`` int32 on the device: this rank's combine status for every peer
        (cached: no kernel per forward); None when no peer needs it."""
        if not self.checks.peers:
            return None
        key = (int(status), layer.fingerprint, layer.index)
        header = self._combine_headers.get(key)
        if header is None:
            values = [0] * HEADER_INTS
            values[Field.STATUS] = int(status)
            values[Field.FINGERPRINT] = layer.fingerprint
            values[Field.LAYER] = layer.index
            values[Field.PHASE] = int(Phase.COMBINE)
            header = torch.tensor(values, dtype=torch.int32, device=self.control.device)
            self._combine_headers[key] = header
        return header

    def placement_header(self, layer: LayerIdentity, number: int) -> torch.Tensor:
        """``[2, W, HEADER_INTS]`` int32: row 0 the header of this rank's placement change
        ``number`` of ``layer`` (shaped as a dispatch header, so a peer in a forward meets it
        as a mismatch), row 1 where the peers' land. Its status is always OK: a failure before
        the change is agreed in a later step, once every rank is known to be in the same one."""
        values = [0] * HEADER_INTS
        values[Field.SEQ] = int(self.control[Control.SEQ])
        values[Field.FINGERPRINT] = layer.fingerprint
        values[Field.LAYER] = layer.index
        values[Field.PHASE] = int(Phase.PLACEMENT)
        values[Field.NUM_CHUNKS] = number
        world = self.comm.world_size
        header = torch.tensor(values, dtype=torch.int32, device=self.control.device)
        return torch.stack([header.expand(world, -1), torch.empty_like(header.expand(world, -1))])

    def check_placement(self, header_pair: torch.Tensor) -> ForwardMismatchError | None:
        """Every rank's verdict on the placement headers: a mismatch (a peer in a forward, in
        another layer's change, at another change of this layer), or None."""
        _, headers = self.comm.to_host(header_pair)
        return self._mismatch(headers, Phase.PLACEMENT)

    # ----------------------------------------------------------------- checks
    def check_dispatch(
        self,
        header_pair: torch.Tensor,  # [2, W, HEADER_INTS]: sent, and where received ones land
        received: torch.Tensor,  # [W, HEADER_INTS] int32: the header from each rank
        own_error: BaseException | None,
        top_k: int,  # this rank's K (0: no tokens)
        columns: int,  # the columns of this rank's ids (its K, also with no tokens)
        num_chunks: int,  # this rank's chunk count
        explain: Callable[[], BaseException],  # this rank's error when its header says bad ids
    ) -> Outcome:
        """Every rank reaches the same verdict on the dispatch headers."""
        sent_rows, received_rows = header_pair[0, :, Field.NUM_ROWS], received[:, Field.NUM_ROWS]

        def agreed(top_k: int, chunks: int, sizes: ExactSizes | None = None) -> Agreed:
            failed = self.control[Control.FORWARD_FAILED] if self.checks.on_device else None
            return Agreed(top_k, chunks, sent_rows, received_rows, sizes, failed)

        if self.checks.on_device:
            self._record(received, Phase.DISPATCH, top_k)
            return Outcome(error=own_error, agreed=agreed(columns, num_chunks))
        if not self.checks.peers:  # the route's verdict on this rank's ids, read at the end
            sent = header_pair[0, 0]

            def late_error() -> BaseException | None:
                return explain() if int(sent[Field.STATUS]) else None

            return Outcome(own_error, agreed(columns, num_chunks), late_error=late_error)
        sent, headers = self.comm.to_host(header_pair)
        statuses = [row[Field.STATUS] for row in headers]
        if own_error is None and statuses[self.rank]:
            own_error = explain()
        if any(statuses):
            return Outcome(error=self._failure(statuses, own_error))
        mismatch = self._mismatch(headers, Phase.DISPATCH)
        if mismatch is not None:
            return Outcome(error=mismatch)
        ks = [row[Field.TOP_K] for row in headers]
        if len({k for k in (*ks, top_k) if k}) > 1:
            error = EPInputError(
                "topk_ids", "the same K on every rank in one forward", f"K per rank {ks}"
            )
            return Outcome(error=error)
        chunks = max(row[Field.NUM_CHUNKS] for row in headers)
        if not self.checks.exact:
            return Outcome(agreed=agreed(columns, chunks))
        sizes = ExactSizes(
            send_rows=[row[Field.NUM_ROWS] for row in sent],
            recv_rows=[row[Field.NUM_ROWS] for row in headers],
            served_slots=sum(row[Field.NUM_SLOTS] for row in headers),
        )
        return Outcome(agreed=agreed(max(ks) or columns, chunks, sizes))

    def check_combine(
        self,
        statuses: torch.Tensor | None,  # [W, HEADER_INTS] int32; None where none was carried
        own_error: BaseException | None,
    ) -> Outcome:
        """Every rank reaches the same verdict on the combine statuses."""
        if self.checks.on_device:
            if statuses is not None:
                self._record(statuses, Phase.COMBINE, 0)
            return Outcome(error=own_error, failed=self.control[Control.FORWARD_FAILED])
        if statuses is None:
            return Outcome(error=own_error)
        headers = self.comm.to_host(statuses)
        codes = [row[Field.STATUS] for row in headers]
        if any(codes):
            return Outcome(error=self._failure(codes, own_error))
        return Outcome(error=self._mismatch(headers, Phase.COMBINE))

    def _record(self, received: torch.Tensor, phase: Phase, top_k: int) -> None:
        if self.checks.peers:
            self.ops.record_headers(
                received,
                self.control,
                rank=self.rank,
                phase=int(phase),
                top_k=top_k,
                mismatch_status=int(ForwardStatus.MISMATCH),
            )

    def _failure(self, statuses: list[int], own_error: BaseException | None) -> BaseException:
        """Every rank gathers the failures' messages (one more collective, on this path only);
        the failing rank raises its own error, the others a ``RemoteRankError`` naming it."""
        message = None if own_error is None else f"{type(own_error).__name__}: {own_error}"
        messages = self.comm.all_gather_object(message)
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
                differing[rank] = f"is in {_phase_name(row[Field.PHASE])}"
            elif row[Field.SEQ] != own[Field.SEQ] and phase is not Phase.COMBINE:
                differing[rank] = f"is at forward #{row[Field.SEQ]}"
            elif phase is Phase.PLACEMENT and row[Field.NUM_CHUNKS] != own[Field.NUM_CHUNKS]:
                differing[rank] = f"is at placement change #{row[Field.NUM_CHUNKS]}"
            elif (row[Field.FINGERPRINT], row[Field.LAYER]) != (
                own[Field.FINGERPRINT],
                own[Field.LAYER],
            ):
                differing[rank] = (
                    f"runs layer {row[Field.LAYER]} "
                    f"(settings and placement {row[Field.FINGERPRINT]:#x})"
                )
        if not differing:
            return None
        self.control[Control.SEQ] = max(row[Field.SEQ] for row in headers) + 1
        here = (
            f"rank {self.rank} is in {_phase_name(int(phase))} of forward #{own[Field.SEQ]} "
            f"of layer {own[Field.LAYER]} (settings and placement {own[Field.FINGERPRINT]:#x})"
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

    def raise_failures(self, num_experts: int) -> None:
        """This rank's dropped ids (``E = num_experts``) first, then a peer's failure."""
        if self.bad_ids:
            raise EPInputError(
                "topk_ids",
                f"distinct values in [0, {num_experts}) or -1 per row",
                f"{self.bad_ids} out-of-range or repeated ids (replaced by -1)",
            )
        self.raise_peer_failure()

    def raise_peer_failure(self) -> None:
        if self.status:
            reason = f"{self.status.name} in forward #{self.seq} (recorded on the device)"
            raise RemoteRankError(self.rank, reason)


def _phase_name(value: int) -> str:
    names = {
        Phase.DISPATCH: "dispatch",
        Phase.COMBINE: "combine",
        Phase.PLACEMENT: "a placement change",
    }
    return names.get(value, f"phase {value}")  # type: ignore[call-overload]


def invalid_ids_error(topk_ids: torch.Tensor, num_experts: int) -> BaseException:
    """The error for ids the route found invalid on the device (read here on the error path)."""
    try:
        check_topk_id_values(topk_ids, num_experts)
    except EPInputError as error:
        return error
    return EPInputError("topk_ids", f"values in [0, {num_experts}) or -1, distinct", "invalid")


class PhaseContainment:
    """``with``: an unexpected exception inside a phase leaves the peers in a collective this
    rank will not reach: tell them (a notice they poll) and refuse later use. (A class, built
    once per phase: no generator per forward.)"""

    def __init__(self, comm: Comm, phase: str) -> None:
        self.comm = comm
        self.phase = phase

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb) -> bool:
        if error is None or isinstance(
            error, (RemoteRankError, GroupUnusableError, ForwardMismatchError)
        ):
            return False
        self.comm.leave_in_failure(f"failed inside {self.phase}: {type(error).__name__}: {error}")
        return False
