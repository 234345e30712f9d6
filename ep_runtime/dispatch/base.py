"""The dispatcher protocol: move token rows to the ranks owning their experts, and back.

A transport implements four steps: ``_plan`` (route this rank's tokens, build the header),
``_send`` (the dispatch data; returns what the experts read), ``_return`` (the experts' results
back, with this rank's status) and ``_finish`` (sum each token's results). ``dispatch`` and
``combine`` wrap them in the forward protocol (``protocol.py``): header exchange, checks, failures
carried to every rank, peers watched. They are final: a class that overrides them cannot
register, so every transport runs the same failure path.

One instance per (group, cap, H, top_k, dtype, mode) per process is shared by all layers.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, final

import torch

from ep_runtime.comm import Comm
from ep_runtime.dispatch.peers import DISPATCHER_NOTICE, GroupUnusableError, PeerIdentity, Peers
from ep_runtime.dispatch.protocol import ForwardProtocol, ForwardStatus, Outcome, Phase, Recorded
from ep_runtime.kernels import HeaderFields, Route, route_tokens
from ep_runtime.kernels.layout import HEADER_INTS
from ep_runtime.placement import ExpertPlacement
from ep_runtime.registry import Registry
from ep_runtime.types import (
    ClosedError,
    Dispatched,
    DispatchMode,
    EPInputError,
    ForwardMismatchError,
    RemoteRankError,
    TopkLayout,
)
from ep_runtime.validation import check_topk_id_values

FINAL_METHODS = ("dispatch", "combine")
DEVICE_CHECKS_ENV = "EP_RUNTIME_CHECKS_ON_DEVICE"


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
    poison: bool = False  # debug: NaN in padding rows and filler

    @property
    def placement(self) -> ExpertPlacement:
        return ExpertPlacement(self.num_experts, self.comm.rank, self.comm.world_size)

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def checks_on_device(self) -> bool:
        """Capacity mode on CUDA never syncs: headers are checked on the device. (Tests set
        ``EP_RUNTIME_CHECKS_ON_DEVICE=1`` to run that path's logic on CPU ranks too.)"""
        on_device = self.device.type == "cuda" or os.environ.get(DEVICE_CHECKS_ENV) == "1"
        return self.mode is DispatchMode.CAPACITY and on_device

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


@dataclass(frozen=True)
class PeerSetup:
    """Agreed by all ranks when the first layer on a dispatcher is built."""

    namespace: str  # the store keys of this dispatcher's notices
    identities: list[PeerIdentity]


@dataclass(frozen=True)
class LayerIdentity:
    """Which layer a forward belongs to, carried in every header."""

    fingerprint: int  # of the layer's settings, agreed by all ranks at build
    index: int  # the layer's number on its dispatcher (same on every rank)


@dataclass(frozen=True)
class ForwardHandle:
    """The protocol's part of ``Dispatched.handle``; ``transport`` is the transport's."""

    layer: LayerIdentity
    transport: Any
    late_error: Callable[[], BaseException | None] | None  # world of one: the route's verdict


class Dispatcher(abc.ABC):
    """Moves rows to expert owners (``dispatch``) and sums expert outputs back (``combine``).

    Combine is unweighted: the experts apply router weights exactly once.
    """

    name: ClassVar[str]
    capabilities: ClassVar[DispatcherCapabilities]
    auto_priority: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = [name for name in FINAL_METHODS if name in cls.__dict__]
        if overridden:
            raise TypeError(
                f"{cls.__name__} overrides {overridden}: transports implement _plan, _send, "
                "_return and _finish; the forward protocol around them is the base class's"
            )

    def __init__(self, setup: DispatchSetup, peer_setup: PeerSetup) -> None:
        self.setup = setup
        self.comm = setup.comm
        self.placement = setup.placement
        self.peers = Peers(setup.comm, peer_setup.namespace, peer_setup.identities)
        self.protocol = ForwardProtocol(
            self.peers, setup.device, checks_on_device=setup.checks_on_device
        )
        self._num_layers = 0
        self._closed = False

    # ----------------------------------------------------------------- selection
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

    # ----------------------------------------------------------------- the protocol
    @final
    def dispatch(
        self,
        x: torch.Tensor,  # [T, H] compute dtype
        topk_ids: torch.Tensor,  # [T, K] int32/int64 global ids, -1 = unused
        topk_weights: torch.Tensor,  # [T, K] float32
        layout: TopkLayout,
        *,
        layer: LayerIdentity,
        num_local_chunks: int = 1,
        failure: BaseException | None = None,
    ) -> tuple[Dispatched, int]:
        """Send this rank's rows; returns what the experts read and the forward's chunk count.

        ``failure``: this rank failed before dispatch (bad input); it still takes part, with no
        tokens, so its peers learn it at once (or, capacity mode on CUDA, at ``check()``)."""
        self._check_open()
        self.peers.check_usable()
        if failure is not None:
            if self.comm.world_size == 1:
                raise failure
            x, topk_ids, topk_weights = self._no_tokens()
        top_k = topk_ids.size(1) if x.size(0) else 0
        fields = self.protocol.dispatch_fields(
            ForwardStatus.of(failure), layer.fingerprint, layer.index, top_k, num_local_chunks
        )
        self.peers.layer_in_flight = layer.index
        with self._containing("dispatch"):
            plan = self._plan(x, topk_ids, topk_weights, fields)
            header_pair = plan.header_pair  # [2, W, HEADER_INTS]: sent, received
            received = self.peers.all_to_all(header_pair[0], recv=header_pair[1])

            def explain() -> BaseException:
                return invalid_ids_error(topk_ids, self.setup.num_experts)

            outcome = self.protocol.check(
                header_pair,
                received,
                Phase.DISPATCH,
                failure,
                top_k,
                explain=explain,
                num_chunks=num_local_chunks,
            )
            dispatched = None
            if outcome.error is None or self.setup.checks_on_device:
                dispatched = self._send(plan, layout, outcome)
        if not self.setup.checks_on_device:
            outcome.raise_error()
        assert dispatched is not None
        late_error = None
        if self.comm.world_size == 1:
            sent = header_pair[0, 0]

            def late_error() -> BaseException | None:
                return self.protocol.own_status_error(sent, explain)

        handle = ForwardHandle(layer, dispatched.handle, late_error)
        return _with_handle(dispatched, handle), outcome.num_chunks

    @final
    def combine(
        self,
        expert_output: torch.Tensor | None,  # [R, H] weighted results; None after a failure
        dispatched: Dispatched,
        out: torch.Tensor | None = None,  # [T, H]
        *,
        failure: BaseException | None = None,
    ) -> torch.Tensor:
        """Sum each token's results on its own rank. ``failure``: this rank failed after
        dispatch (its experts raised); it returns zeros with that status, then raises."""
        self._check_open()
        self.peers.check_usable()
        handle: ForwardHandle = dispatched.handle
        status = ForwardStatus.of(failure)
        header = self.protocol.combine_header(status, handle.layer.fingerprint, handle.layer.index)
        with self._containing("combine"):
            returned, statuses = self._return(
                None if failure is not None else expert_output, dispatched, handle.transport, header
            )
            outcome = self.protocol.check(None, statuses, Phase.COMBINE, failure, 0)
            result = None
            if outcome.error is None or self.setup.checks_on_device:
                result = self._finish(returned, handle.transport, out, outcome.failed)
        outcome.raise_error()
        if handle.late_error is not None and (error := handle.late_error()) is not None:
            raise error
        assert result is not None
        return result

    @contextlib.contextmanager
    def _containing(self, phase: str) -> Iterator[None]:
        """An unexpected exception inside a phase leaves the peers in a collective this rank
        will not reach: tell them (a notice they poll) and refuse later use."""
        try:
            yield
        except (RemoteRankError, GroupUnusableError, ForwardMismatchError):
            raise
        except BaseException as error:
            if self.comm.world_size > 1:
                reason = f"failed inside {phase}: {type(error).__name__}: {error}"
                self.peers.post(DISPATCHER_NOTICE, reason)
                self.peers.mark_unusable(f"this rank {reason}")
            raise

    def _route(self, topk_ids: torch.Tensor, fields: HeaderFields) -> tuple[Route, torch.Tensor]:
        """Every transport's first step: destinations of this rank's tokens, ids cast and
        checked, and the header; returns (route, ``[2, W, HEADER_INTS]`` int32 header pair with
        row 0 the header sent to each rank and row 1 where the received headers land)."""
        world = self.comm.world_size
        header_pair = torch.empty(2, world, HEADER_INTS, dtype=torch.int32, device=topk_ids.device)
        route = route_tokens(
            topk_ids,
            num_experts=self.setup.num_experts,
            experts_per_rank=self.placement.num_local_experts,
            world_size=world,
            drop_invalid=True,
            control=self.protocol.control,
            fields=fields,
            header_out=header_pair[0],
            invalid_status=self.protocol.invalid_ids_status,
        )
        return route, header_pair

    def _no_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        device, top_k = self.comm.device, self.setup.max_top_k
        return (
            torch.empty(0, self.setup.hidden_size, dtype=self.setup.dtype, device=device),
            torch.empty(0, top_k, dtype=torch.int32, device=device),
            torch.empty(0, top_k, dtype=torch.float32, device=device),
        )

    # ----------------------------------------------------------------- the transport
    @abc.abstractmethod
    def _plan(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        fields: HeaderFields,
    ) -> Any:
        """Local work before the header exchange; the result has ``header_pair``:
        ``[2, W, HEADER_INTS]`` int32, row 0 the header sent to each rank (built from
        ``fields``), row 1 where the received headers land."""

    @abc.abstractmethod
    def _send(self, plan: Any, layout: TopkLayout, outcome: Outcome) -> Dispatched:
        """The dispatch data; ``outcome`` holds the headers on the host where they were read."""

    @abc.abstractmethod
    def _return(
        self,
        expert_output: torch.Tensor | None,  # None: send zeros (this rank failed)
        dispatched: Dispatched,
        handle: Any,
        status_header: torch.Tensor,  # [HEADER_INTS] int32: this rank's status for every peer
    ) -> tuple[Any, torch.Tensor]:
        """Send the results back with ``status_header``; returns (state for ``_finish``,
        ``[W, HEADER_INTS]`` int32 status headers received from every rank)."""

    @abc.abstractmethod
    def _finish(
        self,
        returned: Any,
        handle: Any,
        out: torch.Tensor | None,
        failed: torch.Tensor | None,  # 0-d int32: nonzero → the forward failed (NaN output)
    ) -> torch.Tensor:
        """``[T, H]``: each token's results summed in fp32, rounded once (into ``out``)."""

    # ----------------------------------------------------------------- life cycle
    def register_layer(self) -> int:
        """A new layer on this dispatcher: its index (the same on every rank)."""
        index = self._num_layers
        self._num_layers += 1
        return index

    def release_layer(self, index: int) -> None:
        """A layer closed: peers waiting in its forwards stop waiting. (After a failure that
        left the group out of step, the peers learn the cause instead.)"""
        if self.peers.unusable_reason is None:
            self.peers.post(f"layer{index}", f"closed layer {index} (EPMoE.close())")

    def take_recorded(self) -> Recorded:
        """Failures recorded on the device since the last call (one host read)."""
        self._check_open()
        return self.protocol.take_recorded()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"dispatcher {self.name!r} used after close()")

    def close(self) -> None:
        self._closed = True
        self.peers.close()


def invalid_ids_error(topk_ids: torch.Tensor, num_experts: int) -> BaseException:
    """The error for ids the route found invalid on the device (read here on the error path)."""
    try:
        check_topk_id_values(topk_ids, num_experts)
    except EPInputError as error:
        return error
    return EPInputError("topk_ids", f"values in [0, {num_experts}) or -1, distinct", "invalid")


def _with_handle(dispatched: Dispatched, handle: ForwardHandle) -> Dispatched:
    return Dispatched(
        hidden_states=dispatched.hidden_states,
        topk_ids=dispatched.topk_ids,
        topk_weights=dispatched.topk_weights,
        layout=dispatched.layout,
        expert_offsets=dispatched.expert_offsets,
        handle=handle,
    )


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


def shared_dispatcher_exists(cls: type[Dispatcher], setup: DispatchSetup) -> bool:
    with _SHARED.lock:
        return (cls.name, *setup.cache_key()) in _SHARED.entries


def acquire_dispatcher(
    cls: type[Dispatcher], setup: DispatchSetup, peer_setup: PeerSetup
) -> Dispatcher:
    """The process-wide instance of ``cls`` for ``setup`` (buffers are shared by all layers)."""
    key = (cls.name, *setup.cache_key())
    with _SHARED.lock:
        entry = _SHARED.entries.get(key)
        if entry is None:
            entry = _SharedEntry(cls(setup, peer_setup))
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
