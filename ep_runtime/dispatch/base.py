"""The dispatcher protocol: move token rows to the ranks owning their experts, and back.

The base class runs every forward: it routes this rank's tokens (the header with them), has the
transport pack them, exchanges and checks the headers (``protocol.py``), and carries failures to
every rank. A transport implements four steps and never calls back:

- ``_pack(x, weights, route)``: local work before the header exchange (no host wait);
- ``_exchange_dispatch(packed, agreed, layout)``: the dispatch data, sized by what the headers
  agreed; returns what the experts read and what combine needs (the handle);
- ``_exchange_combine(results, dispatched, handle, status)``: the experts' results back, with
  this rank's status for every peer when one is given; returns the received data and statuses;
- ``_reduce(returned, handle, out, failed)``: each token's results summed in fp32.

``dispatch`` and ``combine`` are final: a class that overrides them cannot register, so every
transport runs the same failure path. One instance per (group, cap, H, top_k, dtype, mode) per
process is shared by all layers (``cache.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, final

import torch

from ep_runtime.comm import InFlight
from ep_runtime.dispatch.protocol import (
    Agreed,
    ForwardProtocol,
    ForwardStatus,
    LayerIdentity,
    PhaseContainment,
    Recorded,
    invalid_ids_error,
)
from ep_runtime.dispatch.setup import DispatcherCapabilities, DispatchSetup, PeerSetup
from ep_runtime.kernels import Route, resolve_ops
from ep_runtime.kernels.wire import HEADER_INTS, Control, HeaderFields
from ep_runtime.registry import Registry
from ep_runtime.types import ClosedError, Dispatched, TopkLayout

FINAL_METHODS = ("dispatch", "combine", "open_placement_change")
PackedT = TypeVar("PackedT")  # a transport's packed dispatch, before the header exchange
HandleT = TypeVar("HandleT")  # what its combine needs of a dispatch
ReturnedT = TypeVar("ReturnedT")  # what its combine received, for the reduction


@dataclass(frozen=True)
class ForwardHandle(Generic[HandleT]):
    """``Dispatched.handle``: the protocol's part, and the transport's."""

    layer: LayerIdentity
    transport: HandleT
    late_error: Callable[[], BaseException | None] | None  # world of one: the route's verdict


class Dispatcher(abc.ABC, Generic[PackedT, HandleT, ReturnedT]):
    """Moves rows to expert owners (``dispatch``) and sums expert outputs back (``combine``).

    Combine is unweighted: the experts apply router weights exactly once.
    """

    name: ClassVar[str]
    capabilities: ClassVar[DispatcherCapabilities]
    auto_priority: ClassVar[int] = 0
    # exact mode: the most tokens per rank one round may carry, where the transport's buffers
    # have a fixed size (an instance sets it from its setup); None: sized per forward, no bound
    max_round_tokens: int | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = [name for name in FINAL_METHODS if name in cls.__dict__]
        if overridden:
            raise TypeError(
                f"{cls.__name__} overrides {overridden}: transports implement _pack, "
                "_exchange_dispatch, _exchange_combine and _reduce; the forward protocol "
                "around them is the base class's"
            )

    def __init__(self, setup: DispatchSetup, peer_setup: PeerSetup) -> None:
        self.setup = setup
        self.comm = setup.comm.watched(peer_setup.namespace, peer_setup.identities)
        self.placement = setup.placement
        self.ops = resolve_ops(setup.device)
        self.protocol = ForwardProtocol(self.comm, self.ops, setup.device, setup.checks)
        self._containments = {
            p: PhaseContainment(self.comm, p) for p in ("dispatch", "combine", "placement change")
        }
        self._num_layers = 0
        self._forwards_begun: dict[int, int] = {}  # by layer index
        self._placement_changes: dict[int, tuple[int, int]] = {}  # layer: (forward, changes)
        self._closed = False

    # ----------------------------------------------------------------- selection
    @classmethod
    def unavailable_reason(cls, setup: DispatchSetup) -> str | None:
        """Why this backend cannot run for ``setup`` (packages, hardware), beyond capabilities."""
        return None

    @classmethod
    def refusal(cls, setup: DispatchSetup, layout: TopkLayout | None) -> str | None:
        return cls.capabilities.refusal(setup, layout) or cls.unavailable_reason(setup)

    @classmethod
    def auto_refusal(cls, setup: DispatchSetup) -> str | None:
        """Why ``"auto"`` must not pick it although it can run (named explicitly, it runs)."""
        return None

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
        slot_load: torch.Tensor | None = None,  # [E] int64
    ) -> tuple[Dispatched, int]:
        """Send this rank's rows; returns what the experts read and the forward's chunk count.

        ``failure``: this rank failed before dispatch (bad input); it still takes part, with no
        tokens, so its peers learn it at once (or, capacity mode on CUDA, at ``check()``).
        ``slot_load``: each (token, expert) pair sent adds 1 to its expert's bin (in the route's
        launch: the layer's load counts cost no kernel of their own)."""
        self._check_open()
        self.comm.check_usable()
        if failure is not None:
            self.protocol.raise_if_alone(failure)
            x, topk_ids, topk_weights = self._no_tokens()
        top_k = topk_ids.size(1) if x.size(0) else 0
        status = ForwardStatus.of(failure)
        fields = self.protocol.dispatch_fields(status, layer, top_k, num_local_chunks)
        number = self._forwards_begun[layer.index] = self._forwards_begun.get(layer.index, 0) + 1
        self.comm.in_flight = InFlight(layer.index, number)
        with self._containments["dispatch"]:
            route, header_pair = self._route(topk_ids, fields, slot_load)
            packed = self._pack(x, topk_weights, route)
            received = self.comm.all_to_all(header_pair[0], recv=header_pair[1])
            outcome = self.protocol.check_dispatch(
                header_pair,
                received,
                failure,
                top_k,
                topk_ids.size(1),
                num_local_chunks,
                explain=lambda: invalid_ids_error(topk_ids, self.setup.num_experts),
            )
            sent = None
            if outcome.error is None or self.protocol.checks.on_device:  # device: NaN, go on
                assert outcome.agreed is not None
                sent = self._exchange_dispatch(packed, outcome.agreed, layout)
        if not self.protocol.checks.on_device:
            outcome.raise_error()
        assert sent is not None and outcome.agreed is not None
        d, transport = sent
        handle = ForwardHandle(layer, transport, outcome.late_error)
        with_handle = Dispatched(
            d.hidden_states,
            d.topk_ids,
            d.topk_weights,
            d.layout,
            d.expert_offsets,
            handle,
            hidden_states_scale=d.hidden_states_scale,
        )
        return with_handle, outcome.agreed.num_chunks

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
        self.comm.check_usable()
        handle: ForwardHandle[HandleT] = dispatched.handle
        status = self.protocol.status_to_carry(ForwardStatus.of(failure), handle.layer)
        with self._containments["combine"]:
            results = None if failure is not None else expert_output
            returned, statuses = self._exchange_combine(
                results, dispatched, handle.transport, status
            )
            outcome = self.protocol.check_combine(statuses, failure)
            result = None
            if outcome.error is None or self.protocol.checks.on_device:
                result = self._reduce(returned, handle.transport, out, outcome.failed)
        outcome.raise_error()
        if handle.late_error is not None and (error := handle.late_error()) is not None:
            raise error
        assert result is not None
        return result

    @final
    def open_placement_change(self, layer: LayerIdentity) -> str:
        """The first step of a placement change of ``layer`` (eplb/transaction.py): one header
        exchange shaped as a forward's, so a peer that is elsewhere (in a forward, in another
        layer's change, at another change of this one) is named on every rank by a
        ``ForwardMismatchError`` instead of being paired with. Returns the change's name, the
        same on every rank and never reused (the forward number and the changes since it);
        later notices about the layer concern the change as they would its next forward."""
        self._check_open()
        self.comm.check_usable()
        seq = int(self.protocol.control[Control.SEQ])
        last_seq, count = self._placement_changes.get(layer.index, (seq, 0))
        number = count + 1 if last_seq == seq else 1
        self._placement_changes[layer.index] = (seq, number)
        if self.protocol.checks.peers:
            self.comm.in_flight = InFlight(
                layer.index, self._forwards_begun.get(layer.index, 0) + 1
            )
            with self._containments["placement change"]:
                header_pair = self.protocol.placement_header(layer, number)
                self.comm.all_to_all(header_pair[0], recv=header_pair[1])
                mismatch = self.protocol.check_placement(header_pair)
            if mismatch is not None:
                raise mismatch
        return f"layer{layer.index}/forward{seq}/change{number}"

    def _route(
        self, topk_ids: torch.Tensor, fields: HeaderFields, slot_load: torch.Tensor | None
    ) -> tuple[Route, torch.Tensor]:
        """Destinations of this rank's tokens, ids cast and checked, and the header; returns
        (route, ``[2, W, HEADER_INTS]`` int32 header pair with row 0 the header sent to each
        rank and row 1 where the received headers land)."""
        world = self.comm.world_size
        header_pair = torch.empty(2, world, HEADER_INTS, dtype=torch.int32, device=topk_ids.device)
        route = self.ops.route_tokens(
            topk_ids,
            num_experts=self.setup.num_experts,
            experts_per_rank=self.placement.num_local_experts,
            world_size=world,
            drop_invalid=True,
            control=self.protocol.control,
            fields=fields,
            header_out=header_pair[0],
            invalid_status=self.protocol.invalid_ids_status,
            slot_load=slot_load,
            scratch=self.protocol.route_scratch,
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
    def _pack(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K]
        route: Route,  # route.ids: [T, K] int32, invalid ids dropped
    ) -> PackedT:
        """Local work before the header exchange; nothing here waits for the host."""

    @abc.abstractmethod
    def _exchange_dispatch(
        self, packed: PackedT, agreed: Agreed, layout: TopkLayout
    ) -> tuple[Dispatched, HandleT]:
        """The dispatch data, sized from ``agreed``; what the experts read (``handle`` unset)
        and what the combine needs."""

    @abc.abstractmethod
    def _exchange_combine(
        self,
        expert_output: torch.Tensor | None,  # [R, H]; None: send zeros (this rank failed)
        dispatched: Dispatched,
        handle: HandleT,
        status: torch.Tensor | None,  # [HEADER_INTS] int32 this rank's status for every peer
    ) -> tuple[ReturnedT, torch.Tensor | None]:
        """Send the results back with ``status``; returns (what ``_reduce`` reads,
        ``[W, HEADER_INTS]`` int32 statuses from every rank). ``status`` None: no peer takes
        part, nothing needs to move (and None comes back for the statuses)."""

    @abc.abstractmethod
    def _reduce(
        self,
        returned: ReturnedT,
        handle: HandleT,
        out: torch.Tensor | None,  # [T, H]
        failed: torch.Tensor | None,  # 0-d int32: nonzero → the forward failed (NaN output)
    ) -> torch.Tensor:
        """``[T, H]``: each token's results summed in fp32, rounded once (into ``out``)."""

    # ----------------------------------------------------------------- life cycle
    def register_layer(self) -> int:
        """A new layer on this dispatcher: its index (the same on every rank)."""
        self._num_layers += 1
        return self._num_layers - 1

    def release_layer(self, index: int) -> None:
        """A layer closed: peers waiting in its later forwards stop waiting; a peer still
        finishing one this rank took its whole part in is not stuck. (After a failure that left
        the group out of step, the peers learn the cause instead.)"""
        if self.comm.unusable_reason is None:
            forwards = self._forwards_begun.get(index, 0)
            text = f"closed layer {index} (EPMoE.close()) after its forward {forwards}"
            self.comm.post(f"layer{index}", text, after_forward=forwards)

    def take_recorded(self) -> Recorded:
        """Failures recorded on the device since the last call (one host read)."""
        self._check_open()
        return self.protocol.take_recorded()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"dispatcher {self.name!r} used after close()")

    def close(self) -> None:
        self._closed = True
        self.comm.close()


DISPATCHERS: Registry[type[Dispatcher]] = Registry("dispatcher")
