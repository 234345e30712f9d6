"""The dispatcher protocol: move token rows to the ranks owning their experts, and back.

A dispatcher declares what it supports (``DispatcherCapabilities``) and why it cannot run here
(``unavailable_reason``); the layer picks one through ``DISPATCHERS`` and never branches on names.
One instance per (group, cap, H, top_k, dtype, mode) per process is shared by all layers.
"""

from __future__ import annotations

import abc
import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Generic, NoReturn, TypeVar

import torch

from ep_runtime.comm import Comm
from ep_runtime.placement import ExpertPlacement
from ep_runtime.registry import Registry
from ep_runtime.types import (
    ClosedError,
    Dispatched,
    DispatchMode,
    EPInputError,
    RemoteRankError,
    TopkLayout,
)

R = TypeVar("R")


@dataclass(frozen=True)
class DispatcherCapabilities:
    layouts: frozenset[TopkLayout]
    modes: frozenset[DispatchMode]
    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    min_world_size: int = 1


@dataclass(frozen=True)
class DispatchSetup:
    """Everything a dispatcher instance is built for (and shared by)."""

    comm: Comm
    num_experts: int
    hidden_size: int
    max_top_k: int
    max_tokens_per_rank: int
    dtype: torch.dtype
    mode: DispatchMode
    poison: bool = False  # debug: NaN in padding rows, preallocated outputs and -1-slot weights

    @property
    def placement(self) -> ExpertPlacement:
        return ExpertPlacement(self.num_experts, self.comm.rank, self.comm.world_size)

    @property
    def device(self) -> torch.device:
        return self.comm.device

    def cache_key(self) -> tuple:
        group_key = id(self.comm.group) if self.comm.group is not None else None
        return (
            group_key,
            self.comm.device,
            self.num_experts,
            self.hidden_size,
            self.max_top_k,
            self.max_tokens_per_rank,
            self.dtype,
            self.mode,
            self.poison,
        )


class Pending(Generic[R]):
    """A waitable result. ``wait()`` returns it; synchronous backends complete at once."""

    def __init__(self, finish: Callable[[], R]) -> None:
        self._finish = finish
        self._value: R | None = None
        self._done = False

    @staticmethod
    def completed(value: R) -> Pending[R]:
        return Pending(lambda: value)

    def wait(self) -> R:
        if not self._done:
            self._value = self._finish()
            self._done = True
        return self._value  # type: ignore[return-value]


class ForwardStatus(enum.IntEnum):
    """Status a rank carries in a forward's first collective, so peers never wait on it."""

    OK = 0
    INPUT_ERROR = 1
    INTERNAL_ERROR = 2

    @staticmethod
    def of(error: BaseException | None) -> ForwardStatus:
        if error is None:
            return ForwardStatus.OK
        return (
            ForwardStatus.INPUT_ERROR
            if isinstance(error, ValueError)
            else ForwardStatus.INTERNAL_ERROR
        )


def raise_if_any_failed(comm: Comm, statuses: list[int], own_error: BaseException | None) -> None:
    """Every rank calls this after a collective that carried each rank's ``ForwardStatus``.

    When any rank failed, all ranks gather the messages (one extra collective, error path only);
    the failing rank raises its own error, the others a ``RemoteRankError`` naming it.
    """
    if not any(statuses):
        return
    message = None if own_error is None else f"{type(own_error).__name__}: {own_error}"
    messages = comm.all_gather_object(message)
    if own_error is not None:
        raise own_error
    failed = next(rank for rank, status in enumerate(statuses) if status)
    reason = messages[failed] or ForwardStatus(statuses[failed]).name
    raise RemoteRankError(failed, str(reason))


STATUS, NUM_CHUNKS, TOP_K = 0, 1, 2  # header columns of every dispatcher's first collective


class PeerStatus:
    """Each rank's ``(status, num_local_chunks, K)`` header as seen by this rank.

    Where host reads are free (exact mode, CPU) the headers are checked at once; capacity mode on
    CUDA records them on the device without a sync, and ``check()`` raises later.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._recorded = torch.zeros(comm.world_size, dtype=torch.int32, device=comm.device)

    def raise_on_host(
        self, headers: list[list[int]], top_k: int, own_error: BaseException | None = None
    ) -> int:
        """Raise for a failed rank or a K that differs; returns the forward's chunk count.
        K = 0 (a rank with no tokens, exact mode) agrees with any K."""
        raise_if_any_failed(self.comm, [h[STATUS] for h in headers], own_error)
        ks = [h[TOP_K] for h in headers]
        if len({k for k in (*ks, top_k) if k}) > 1:
            raise EPInputError(
                "topk_ids", "the same K on every rank in one forward", f"K per rank {ks}"
            )
        return max(h[NUM_CHUNKS] for h in headers)

    def record_on_device(self, headers: torch.Tensor, top_k: int) -> None:
        """``headers [W, >= 3]`` on the device: keep the worst status per rank (a K that
        differs counts as an input error), no host sync."""
        status = torch.where(
            headers[:, TOP_K] != top_k,
            torch.full_like(headers[:, STATUS], int(ForwardStatus.INPUT_ERROR)),
            headers[:, STATUS],
        )
        torch.maximum(self._recorded, status.to(torch.int32), out=self._recorded)

    def check(self) -> None:
        statuses = self._recorded.tolist()
        if any(statuses):
            self._recorded.zero_()
            failed = next(rank for rank, status in enumerate(statuses) if status)
            reason = f"{ForwardStatus(statuses[failed]).name} during a capacity-mode forward"
            raise RemoteRankError(failed, reason)


class Dispatcher(abc.ABC):
    """Moves rows to expert owners (``dispatch``) and sums expert outputs back (``combine``).

    Combine is unweighted: the experts apply router weights exactly once.
    """

    name: ClassVar[str]
    capabilities: ClassVar[DispatcherCapabilities]
    auto_priority: ClassVar[int] = 0

    def __init__(self, setup: DispatchSetup) -> None:
        self.setup = setup
        self.comm = setup.comm
        self.placement = setup.placement
        self.peer_status = PeerStatus(setup.comm)
        self._closed = False

    @property
    def host_reads_free(self) -> bool:
        """Reading device values costs nothing on CPU; on CUDA, capacity mode never syncs."""
        return self.setup.mode is DispatchMode.EXACT or self.comm.device.type == "cpu"

    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        """Why this backend cannot run for ``setup`` (packages, hardware), beyond capabilities."""
        return None

    @classmethod
    def refusal(cls, setup: DispatchSetup, layout: TopkLayout | None) -> str | None:
        caps = cls.capabilities
        if setup.comm.device.type not in caps.device_types:
            return f"runs on {sorted(caps.device_types)}, not {setup.comm.device.type}"
        if setup.mode not in caps.modes:
            return f"supports modes {sorted(m.value for m in caps.modes)}, not {setup.mode.value}"
        if layout is not None and layout not in caps.layouts:
            return f"supports layouts {sorted(x.value for x in caps.layouts)}, not {layout.value}"
        if setup.dtype not in caps.dtypes:
            return f"supports dtypes {sorted(map(str, caps.dtypes))}, not {setup.dtype}"
        if setup.comm.world_size < caps.min_world_size:
            return f"needs a group of >= {caps.min_world_size} ranks, got {setup.comm.world_size}"
        return cls.unavailable_reason(setup)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"dispatcher {self.name!r} used after close()")

    @abc.abstractmethod
    def dispatch_async(
        self,
        x: torch.Tensor,  # [T, H] compute dtype
        topk_ids: torch.Tensor,  # [T, K] int32/int64 global ids, -1 = unused
        topk_weights: torch.Tensor,  # [T, K] float32
        layout: TopkLayout,
        *,
        num_local_chunks: int = 1,
    ) -> Pending[Dispatched]:
        """Start a dispatch; the first collective carries this rank's status and chunk count."""

    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: TopkLayout,
        *,
        num_local_chunks: int = 1,
    ) -> Dispatched:
        return self.dispatch_async(
            x, topk_ids, topk_weights, layout, num_local_chunks=num_local_chunks
        ).wait()

    @abc.abstractmethod
    def combine_async(
        self, expert_output: torch.Tensor, dispatched: Dispatched, out: torch.Tensor | None = None
    ) -> Pending[torch.Tensor]:
        """Start a combine of ``expert_output`` (``[R, H]``, weighted); result ``[T, H]``."""

    def combine(
        self, expert_output: torch.Tensor, dispatched: Dispatched, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.combine_async(expert_output, dispatched, out).wait()

    @abc.abstractmethod
    def abort(self, error: BaseException, layout: TopkLayout) -> NoReturn:
        """Take part in this forward's collectives carrying ``error``, so peers fail, then raise."""

    def check(self) -> None:
        """Raise errors recorded on the device without a host sync (capacity mode)."""
        self._check_open()
        self.peer_status.check()

    def close(self) -> None:
        self._closed = True


DISPATCHERS: Registry[type[Dispatcher]] = Registry("dispatcher")


@dataclass
class _SharedEntry:
    dispatcher: Dispatcher
    users: int = 0


@dataclass
class _SharedDispatchers:
    entries: dict[tuple, _SharedEntry] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_SHARED = _SharedDispatchers()


def acquire_dispatcher(cls: type[Dispatcher], setup: DispatchSetup) -> Dispatcher:
    """The process-wide instance of ``cls`` for ``setup`` (buffers are shared by all layers)."""
    key = (cls.name, *setup.cache_key())
    with _SHARED.lock:
        entry = _SHARED.entries.get(key)
        if entry is None:
            entry = _SharedEntry(cls(setup))
            _SHARED.entries[key] = entry
        entry.users += 1
        return entry.dispatcher


def release_dispatcher(dispatcher: Dispatcher) -> None:
    """Drop one user; the last one closes the dispatcher and frees its buffers."""
    with _SHARED.lock:
        for key, entry in list(_SHARED.entries.items()):
            if entry.dispatcher is dispatcher:
                entry.users -= 1
                if entry.users == 0:
                    del _SHARED.entries[key]
                    dispatcher.close()
                return
