"""This rank's view of its group: the collectives EP needs, notices to the peers, and liveness.

``Comm.create`` gives a ``GroupComm`` over a torch.distributed group, or a ``SingleRankComm`` for a
world of one (no group, or a group of one rank): the same methods, where collectives hand back
what was sent and there is nobody to notify. Code above this module never asks whether it is
alone.

A dispatcher watches its peers (``watched``): a rank waiting in a collective (gloo blocks the
host; exact mode on NCCL reads counts on the host) polls, besides the collective, the notices
peers post in the group's store (a layer closed, a failure inside a forward, an exception that
ends the process) and, for peers on this host, whether their process still exists. Either turns
the wait into a ``RemoteRankError`` naming the peer within a fraction of a second, instead of
the group timeout. A transport error (a peer's connection closed) is diagnosed the same way.
Leaving a collective early leaves the group out of step: the comm is then marked unusable and
every later call says why.
"""

from __future__ import annotations

import abc
import contextlib
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from ep_runtime import comm_process
from ep_runtime.comm_notices import DISPATCHER_NOTICE, InFlight, NoticeBoard
from ep_runtime.types import GroupUnusableError, RemoteRankError

T = TypeVar("T")

POLL_START_S = 0.05  # a collective pending this long starts looking for trouble
POLL_EVERY_S = 0.2
SETTLE_S = 0.25  # a collective gets this long to end by itself once a peer is in trouble
SPIN_S = 0.002  # a device read spins this long before sleeping between polls
DIAGNOSE_S = 5.0  # after a transport error: how long to wait for the cause to show
VOTE_TIMEOUT_S = 600.0  # a vote whose voters are all alive but silent this long fails


@dataclass(frozen=True)
class PeerIdentity:
    """Where a rank's process runs, for liveness checks."""

    host: str
    pid: int

    @staticmethod
    def of_this_process() -> PeerIdentity:
        return PeerIdentity(socket.gethostname(), os.getpid())


class Comm(abc.ABC):
    """A group of ``world_size`` ranks as seen from ``rank``, and the device data moves on."""

    def __init__(
        self, group: dist.ProcessGroup | None, rank: int, world_size: int, device: torch.device
    ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.unusable_reason: str | None = None
        self.in_flight: InFlight | None = None  # the forward whose notices concern a wait

    @staticmethod
    def create(group: dist.ProcessGroup | None, device: torch.device | None = None) -> Comm:
        """Wrap ``group``; ``None`` means the default group if initialised, else a world of 1."""
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if device is None:
            device = default_device(group)
        if group is None:
            return SingleRankComm(device)
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if world_size == 1:
            return SingleRankComm(device, group)
        return GroupComm(group, rank, world_size, device)

    @property
    def backend(self) -> str:
        return "none" if self.group is None else str(dist.get_backend(self.group))

    @property
    @abc.abstractmethod
    def has_peers(self) -> bool:
        """Whether any other rank takes part (headers to agree on, statuses to carry)."""

    # ----------------------------------------------------------------- collectives
    @abc.abstractmethod
    def all_to_all(
        self,
        send: torch.Tensor,
        *,
        recv: torch.Tensor | None = None,
        send_splits: list[int] | None = None,
        recv_splits: list[int] | None = None,
    ) -> torch.Tensor:
        """All-to-all along dim 0 (uneven with splits); returns what arrived (into ``recv``
        when given; a world of one returns ``send`` itself)."""

    @abc.abstractmethod
    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""

    @abc.abstractmethod
    def vote(self, ballot: str, verdict: str | None) -> list[str | None]:
        """Every rank's ``verdict`` on ``ballot`` (``None``: it can go ahead; else why not), the
        same list on every rank that returns. ``ballot`` names one decision, the same on every
        rank and never reused. A rank that dies without voting is counted as a failure (its
        verdict says so) on every survivor; one that dies after voting, with its vote."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        """``all_to_all`` into ``output`` (torch's argument order)."""
        received = self.all_to_all(
            input, recv=output, send_splits=input_split_sizes, recv_splits=output_split_sizes
        )
        if received is not output:
            output.copy_(received)

    def to_host(self, tensor: torch.Tensor) -> list:
        """``tensor.tolist()``."""
        return tensor.tolist()

    # ----------------------------------------------------------------- notices and liveness
    @abc.abstractmethod
    def watched(self, namespace: str, identities: list[PeerIdentity]) -> Comm:
        """The same group, posting and polling notices under ``namespace`` and watching the
        processes ``identities`` names (one per rank)."""

    @abc.abstractmethod
    def post(self, topic: str, text: str, about: int | None = None, after_forward: int = 0) -> None:
        """Leave a notice for the peers (best effort). ``about``: the rank it is about, when
        not this one (passing on what this rank found out). ``after_forward``: on a layer's
        topic, the notice concerns only its forwards numbered above this (a layer that closed
        after its part in forwards 1..n: a peer still finishing one of those is not stuck)."""

    @abc.abstractmethod
    def leave_in_failure(self, reason: str) -> None:
        """This rank leaves a collective its peers wait in: tell them, refuse later use."""

    def mark_unusable(self, reason: str) -> None:
        if self.unusable_reason is None:
            self.unusable_reason = reason

    def check_usable(self) -> None:
        if self.unusable_reason is not None:
            raise GroupUnusableError(
                f"this dispatcher's process group is out of step since {self.unusable_reason}; "
                "build new layers on a new process group"
            )

    @abc.abstractmethod
    def close(self) -> None:
        """Stop watching (a watched comm)."""


class SingleRankComm(Comm):
    """A world of one: collectives hand back what was sent; there is no one to notify."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(group, 0, 1, device)

    @property
    def has_peers(self) -> bool:
        return False

    def all_to_all(self, send, *, recv=None, send_splits=None, recv_splits=None) -> torch.Tensor:
        self.check_usable()
        return send

    def all_gather_object(self, obj: T) -> list[T]:
        return [obj]

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.check_usable()

    def vote(self, ballot: str, verdict: str | None) -> list[str | None]:
        self.check_usable()
        return [verdict]

    def barrier(self) -> None:
        return None

    def watched(self, namespace: str, identities: list[PeerIdentity]) -> Comm:
        return SingleRankComm(self.device, self.group)

    def post(self, topic: str, text: str, about: int | None = None, after_forward: int = 0) -> None:
        return None

    def leave_in_failure(self, reason: str) -> None:
        return None  # nobody waits for this rank; the error it raises says it all

    def close(self) -> None:
        return None


class GroupComm(Comm):
    """Two or more ranks over a torch.distributed group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        device: torch.device,
        watch: NoticeBoard | None = None,
    ) -> None:
        super().__init__(group, rank, world_size, device)
        self._watch = watch
        self._nothing_new_since: tuple[int, InFlight | None] = (0, None)  # (count, in_flight)

    @property
    def has_peers(self) -> bool:
        return True

    # ----------------------------------------------------------------- collectives
    def all_to_all(self, send, *, recv=None, send_splits=None, recv_splits=None) -> torch.Tensor:
        self.check_usable()
        if recv is None:
            rows = send.size(0) if recv_splits is None else sum(recv_splits)
            recv = send.new_empty(rows, *send.shape[1:])
        work = dist.all_to_all_single(
            recv, send, recv_splits, send_splits, group=self.group, async_op=True
        )
        self._wait(work, "all_to_all")
        return recv

    def all_gather_object(self, obj: T) -> list[T]:
        """Watched, as two all-to-alls (the sizes, then the pickled objects), where the comm
        watches its peers; torch's ``all_gather_object`` (it blocks) where it does not."""
        self.check_usable()
        if self._watch is None:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, obj, group=self.group)
            return gathered
        world, device = self.world_size, self.device
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.full((world, 1), payload.numel(), dtype=torch.int64, device=device)
        sizes = [row[0] for row in self.to_host(self.all_to_all(size))]
        send = torch.zeros(world, max(sizes), dtype=torch.uint8, device=device)
        send[:, : payload.numel()] = payload.to(device)
        received = self.to_host(self.all_to_all(send))  # polled: NCCL waits on the stream
        return [pickle.loads(bytes(row[:n])) for row, n in zip(received, sizes, strict=True)]

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.check_usable()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self._wait(work, "all_reduce")

    def vote(self, ballot: str, verdict: str | None) -> list[str | None]:
        """Through the group's store where there is one: each vote is a key written once, so a
        death in the middle cannot split the survivors (each reads the same keys; a rank whose
        key is missing when it is known to be gone never writes it). Else a watched all-gather."""
        self.check_usable()
        board = self._watch
        if board is None or board.store is None:
            return self.all_gather_object(verdict)
        board.cast_vote(ballot, self.rank, verdict)
        deadline = time.monotonic() + VOTE_TIMEOUT_S
        while (votes := board.votes(ballot, self.world_size)) is None:
            for rank, reason in self._troubles():
                if rank < 0:
                    self.mark_unusable(reason)
                    raise GroupUnusableError(f"vote on {ballot}: {reason}")
                if not board.has_voted(ballot, rank):  # gone before voting: it never will
                    self.post(DISPATCHER_NOTICE, reason, about=rank)
                    self.mark_unusable(f"rank {rank} {reason}")
                    self._abort_group()
                    return board.votes_so_far(ballot, self.world_size, rank, reason)
            if time.monotonic() > deadline:
                self.mark_unusable(f"the vote on {ballot} timed out")
                raise GroupUnusableError(
                    f"vote on {ballot}: a rank did not vote within {VOTE_TIMEOUT_S:.0f} s"
                )
            time.sleep(POLL_EVERY_S / 4)
        return votes

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def to_host(self, tensor: torch.Tensor) -> list:
        """On CUDA the wait polls for peers instead of blocking."""
        if tensor.device.type != "cuda":
            return tensor.tolist()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._poll(done.query, "a device read")
        return host.tolist()

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work``; watched on gloo (the host blocks), in slices, looking for trouble
        between them. A slice that times out leaves the collective running (gloo keeps it)."""
        if self._watch is None or "gloo" not in self.backend:  # NCCL: the stream waits
            work.wait()
            return
        timeout = timedelta(seconds=POLL_START_S)
        while True:
            try:
                work.wait(timeout)
                return
            except Exception:
                if work.is_completed():  # failed, or finished just after the slice timed out
                    self._wait_completed(work, what)
                    return
            self._raise_on_trouble(what, settle=work)
            timeout = timedelta(seconds=POLL_EVERY_S)

    def _wait_completed(self, work: dist.Work, what: str) -> None:
        """A completed ``work``: its own outcome, not the slice's timeout (under load a
        collective can finish between the slice timing out and the check; that is a success)."""
        try:
            work.wait()
        except Exception as error:
            self._diagnose(error, what)

    def _poll(self, done: Callable[[], bool], what: str) -> None:
        """Until ``done()``: spin briefly, then sleep in short steps, looking for trouble."""
        start = time.monotonic()
        next_look = start + POLL_START_S
        while not done():
            now = time.monotonic()
            if now - start > SPIN_S:
                time.sleep(0.0005)
            if now >= next_look:
                self._raise_on_trouble(what)
                next_look = now + POLL_EVERY_S

    # ----------------------------------------------------------------- notices and liveness
    def watched(self, namespace: str, identities: list[PeerIdentity]) -> Comm:
        store = comm_process.group_store(self.group)
        local_host = socket.gethostname()
        local_peers = tuple(
            (rank, identity.pid)
            for rank, identity in enumerate(identities)
            if rank != self.rank and identity.host == local_host
        )
        comm = GroupComm(
            self.group,
            self.rank,
            self.world_size,
            self.device,
            NoticeBoard(namespace, store, local_peers),
        )
        if store is not None:
            comm_process.notify_peers_at_exit(comm, gloo="gloo" in self.backend)
        return comm

    def post(self, topic: str, text: str, about: int | None = None, after_forward: int = 0) -> None:
        if self._watch is not None:
            self._watch.post(self.rank, topic, text, about, after_forward)

    def leave_in_failure(self, reason: str) -> None:
        self.post(DISPATCHER_NOTICE, reason)
        self.mark_unusable(f"this rank {reason}")

    def close(self) -> None:
        comm_process.stop_notifying(self)

    def _notices(self) -> list[tuple[int, str]]:
        """(rank, text) of the notices that concern the forward in flight, earliest first (a
        peer that failed because of another posts a notice too: the first one is the cause)."""
        if self._watch is None or self._watch.store is None:
            return []
        count = self._watch.count()
        if (count, self.in_flight) == self._nothing_new_since:
            return []
        found = self._watch.read(self.rank, self.world_size, self.in_flight)
        if not found:
            self._nothing_new_since = (count, self.in_flight)
        return found

    def _troubles(self) -> list[tuple[int, str]]:
        """Peers' notices (they say why), earliest first, then peers on this host whose process
        is gone, then an unreachable store (rank -1: its host may be the one that died)."""
        store_error = None
        try:
            found = self._notices()
        except Exception as error:  # the store's host may be the dead one
            found, store_error = [], error
        for rank, pid in self._watch.local_peers if self._watch is not None else ():
            if comm_process.process_is_gone(pid):
                found.append((rank, f"is gone: its process (pid {pid} on this host) ended"))
        if store_error is not None:
            kind = type(store_error).__name__
            found.append((-1, f"the group's store is unreachable ({kind}: {store_error})"))
        return found

    def _trouble(self) -> tuple[int, str] | None:
        """The first of ``_troubles()``, or None."""
        troubles = self._troubles()
        return troubles[0] if troubles else None

    def _raise_on_trouble(
        self, what: str, cause: BaseException | None = None, settle: dist.Work | None = None
    ) -> None:
        """Raise if a peer is in trouble. ``settle``: the collective this rank is about to leave;
        it gets a moment to end by itself first (with a dead peer gloo fails it at once), so no
        collective is left running in gloo's threads when the process exits."""
        found = self._trouble()
        if found is None:
            return
        deadline = time.monotonic() + SETTLE_S
        while settle is not None and not settle.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        rank, reason = found
        if rank >= 0 and self.unusable_reason is None:  # pass it on: peers elsewhere learn it
            self.post(DISPATCHER_NOTICE, reason, about=rank)
        self.mark_unusable(f"rank {rank} {reason}" if rank >= 0 else reason)
        self._abort_group()
        if rank < 0:
            raise GroupUnusableError(f"{what}: {reason}") from cause
        raise RemoteRankError(rank, f"{reason} (seen while waiting in {what})") from cause

    def _diagnose(self, error: Exception, what: str) -> None:
        """A transport error: wait briefly for the peer's notice or death to name it."""
        deadline = time.monotonic() + DIAGNOSE_S
        while time.monotonic() < deadline:
            self._raise_on_trouble(what, error)
            time.sleep(0.05)
        self.mark_unusable(f"{what} failed: {error}")
        raise GroupUnusableError(
            f"{what} failed and no peer is known to have failed: {type(error).__name__}: {error}"
        ) from error

    def _abort_group(self) -> None:
        """This rank leaves a collective its peers will never finish: abort the group, so the
        collective left behind ends now instead of blocking the process's exit (gloo aborts a
        process that exits with a collective still waiting) and no later call pairs with it."""
        abort = getattr(self.group, "abort", None)
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()


def default_device(group: dist.ProcessGroup | None) -> torch.device:
    """CUDA (the current device) for NCCL groups, or for no group when CUDA exists; else CPU."""
    if group is not None:
        backend = str(dist.get_backend(group))
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
