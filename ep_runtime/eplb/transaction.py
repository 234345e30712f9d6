"""A placement change as one transaction: every rank ends on the new placement with the new
weights, or every rank keeps the old placement and the old weights bitwise and raises, the
culprit naming its own error and every other rank a ``RemoteRankError`` naming it.

Every collective goes through the dispatcher's watched comm, so a peer that dies or fails is
named within a second instead of the group timeout. The steps, on every rank:

  1. ``open``: one header exchange shaped as a forward's (``Dispatcher.open_placement_change``):
     a peer in a forward, in another layer's change or at another change of this layer is named
     on every rank (``ForwardMismatchError``) before anything else is exchanged;
  2. ``sum_load``: all-reduce of the per-slot counts;
  -- local: check the load, ``plan`` the new placement and the moves, ``pack`` the outgoing
     slots and ``allocate`` the incoming ones (a failure here is carried into step 3);
  3. ``agree``: all-gather of (status, new placement's fingerprint): all raise unless every rank
     planned the same placement and is ready for the exchange;
  4. ``exchange``: one all-to-all of the slots that move between ranks (none when none does);
  -- local: ``unpack`` the arrivals and ``stage`` them beside the old weights: kept aside for the
     commit to write into the slots where the backend computes with the slot tensors themselves
     (``grouped_mm``, ``triton``, ``reference``); else new slot tensors ``reload``ed into a new
     experts backend while the old one still serves;
  5. ``vote`` (``Comm.vote``): every rank's staging and reload succeeded, or all raise;
  6. commit: the arrivals are copied into their slots (or the new tensors and backend swapped
     in), then the placement and the device tables (copied in place): nothing here allocates,
     and a CUDA graph captured before the change computes with the new experts after it.

Memory: from the staging to the commit a rank holds the arriving slots twice; where a new
backend is staged (backends that convert the weights, or slot weights that are the caller's
tensors), its slot weights and the backend's converted copy twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ep_runtime.comm import Comm
from ep_runtime.eplb.algorithm import rebalanced_placement
from ep_runtime.eplb.device_map import DeviceMap
from ep_runtime.eplb.moves import MovePlan, arrivals, flat_rows, outgoing_slots, plan_moves
from ep_runtime.eplb.placement_map import PlacementMap
from ep_runtime.eplb.stats import LoadStats, RebalanceReport
from ep_runtime.experts.base import Experts
from ep_runtime.types import EPInputError, RemoteRankError


class BalancerState(Protocol):
    """What a placement change reads and commits of a layer's balancer (eplb/balancer.py)."""

    placement: PlacementMap
    device_map: DeviceMap
    num_nodes: int
    owns_weights: bool

    @property
    def has_weights(self) -> bool: ...

    @property
    def slot_weights(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def checked_load(self, load: torch.Tensor) -> torch.Tensor: ...

    def install(
        self,
        new: PlacementMap,
        w13: torch.Tensor,
        w2: torch.Tensor,
        table: torch.Tensor,
        counts: torch.Tensor,
    ) -> None: ...


@dataclass(frozen=True)
class ChangeHooks:
    """What a placement change needs of its layer.

    ``open``: step 1 (``Dispatcher.open_placement_change`` for the layer), returning the
    change's name. ``in_place``: the serving backend computes with the very slot tensors it was
    given (no conversion). ``reload``: a new experts backend loaded with ``[S, rows, H]`` /
    ``[S, H, I]`` slot weights, not yet serving. ``commit``: make it serve (None: the serving
    one stays) under the new placement."""

    comm: Comm
    in_place: bool
    open: Callable[[], str]
    reload: Callable[[torch.Tensor, torch.Tensor], Experts]
    commit: Callable[[Experts | None, PlacementMap], None]


@dataclass(frozen=True)
class _Staged:
    """Everything the commit swaps in, built beside the old state."""

    w13: torch.Tensor  # [S, rows, H]: the slot weights after the commit
    w2: torch.Tensor  # [S, H, I]
    in_place: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (slots, w13, w2 rows)
    experts: Experts | None  # a loaded backend, or None where the serving one stays
    table: torch.Tensor  # the device map's [E, R + 1] table for the new placement
    counts: torch.Tensor  # [E] replicas per expert


def _status(failure: BaseException | None) -> str | None:
    return None if failure is None else f"{type(failure).__name__}: {failure}"


def _raise_failures(statuses: list[str | None], failure: BaseException | None) -> None:
    """This rank's own error, else a ``RemoteRankError`` naming the first rank that failed."""
    if failure is not None:
        raise failure
    for rank, status in enumerate(statuses):
        if status is not None:
            raise RemoteRankError(rank, f"during rebalance: {status}")


class PlacementChange:
    """One rebalance of one layer, run once (``run``); the balancer holds the state it changes."""

    def __init__(self, balancer: BalancerState, hooks: ChangeHooks) -> None:
        self.balancer = balancer
        self.hooks = hooks
        self.comm = hooks.comm
        self.rank = hooks.comm.rank

    def run(self, load: torch.Tensor | None) -> RebalanceReport:
        start = time.perf_counter()
        balancer = self.balancer
        measured = balancer.device_map.take_load(reset=False)
        failure: BaseException | None = None
        logical = None
        try:
            if not balancer.has_weights:
                raise RuntimeError("EPMoE.load_weights() must be called before rebalance()")
            logical = balancer.checked_load(load) if load is not None else None
        except Exception as error:
            failure = error
        ballot = self.hooks.open()  # 1
        self.sum_load(measured)  # 2
        plan = send = received = None
        if failure is None:
            try:
                if logical is None:
                    logical = balancer.placement.fold(measured.cpu())
                plan = self.plan(logical)
                send, received = self.pack(plan), self.allocate(plan)
            except Exception as error:
                failure = error
        self.agree(failure, plan)  # 3
        assert plan is not None and send is not None and received is not None
        self.exchange(plan, send, received)  # 4
        staged = None
        try:
            staged = self.stage(plan, self.unpack(plan, received))
        except Exception as error:
            failure = error
        _raise_failures(self.comm.vote(ballot, _status(failure)), failure)  # 5
        assert staged is not None and logical is not None
        self.commit(plan.new, staged)  # 6
        w13, w2 = staged.w13, staged.w2
        return RebalanceReport(
            before=LoadStats.of_slots(measured, plan.old),
            after=LoadStats.predicted(logical, plan.new),
            changed_slots=len(plan.moves),
            local_copies=plan.num_local_copies,
            remote_slots=len(plan.remote),
            bytes_moved=len(plan.remote) * (w13[0].numel() + w2[0].numel()) * w13.element_size(),
            seconds=time.perf_counter() - start,
        )

    # ----------------------------------------------------------------- collectives
    def sum_load(self, measured: torch.Tensor) -> None:
        self.comm.all_reduce(measured)

    def agree(self, failure: BaseException | None, plan: MovePlan | None) -> None:
        """All raise unless every rank is ready and planned the same placement."""
        own = (_status(failure), None if plan is None else plan.new.fingerprint())
        gathered = self.comm.all_gather_object(own)
        _raise_failures([status for status, _ in gathered], failure)
        if len({fingerprint for _, fingerprint in gathered}) > 1:
            per_rank = ", ".join(f"rank {r} = {fp}" for r, (_, fp) in enumerate(gathered))
            raise EPInputError("load", "the same load on every rank (one placement)", per_rank)

    def exchange(self, plan: MovePlan, send: torch.Tensor, received: torch.Tensor) -> None:
        """The all-to-all of the remote moves, sized from the plan alone (skipped by every rank
        when nothing moves between ranks)."""
        if plan.remote:
            out_counts, in_counts = plan.row_counts(self.rank)
            self.comm.all_to_all_single(received, send, in_counts, out_counts)

    # ----------------------------------------------------------------- local steps
    def plan(self, logical: torch.Tensor) -> MovePlan:
        balancer = self.balancer
        new = rebalanced_placement(logical, balancer.placement, num_nodes=balancer.num_nodes)
        return plan_moves(balancer.placement, new)

    def pack(self, plan: MovePlan) -> torch.Tensor:
        """``[n_out, F]``: this rank's outgoing slots, one flat row each, in exchange order."""
        return flat_rows(*self.balancer.slot_weights, outgoing_slots(plan, self.rank))

    def allocate(self, plan: MovePlan) -> torch.Tensor:
        """``[n_in, F]``: where the incoming slots land."""
        w13, w2 = self.balancer.slot_weights
        _, in_counts = plan.row_counts(self.rank)
        return w13.new_empty(sum(in_counts), w13[0].numel() + w2[0].numel())

    def unpack(
        self, plan: MovePlan, received: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The local slot of each arrival and its ``w13`` / ``w2`` (new tensors)."""
        return arrivals(plan, self.rank, *self.balancer.slot_weights, received)

    def stage(
        self, plan: MovePlan, arrived: tuple[list[int], torch.Tensor, torch.Tensor]
    ) -> _Staged:
        """The arriving slots' weights beside the old ones, and the new device tables. Where the
        backend computes with the slot weights themselves (``ChangeHooks.in_place``) and they
        are the layer's own, the commit writes the arrivals into them (a CUDA graph captured
        before follows); else new slot tensors (nothing old is written) loaded into a new
        experts backend."""
        slots, new13, new2 = arrived
        balancer = self.balancer
        w13, w2 = balancer.slot_weights
        table, counts = balancer.device_map.tables(plan.new)
        if not slots:
            return _Staged(w13, w2, None, None, table, counts)
        index = torch.tensor(slots, dtype=torch.int64, device=w13.device)
        if self.hooks.in_place and balancer.owns_weights:
            return _Staged(w13, w2, (index, new13, new2), None, table, counts)
        w13 = w13.index_copy(0, index, new13)
        w2 = w2.index_copy(0, index, new2)
        return _Staged(w13, w2, None, self.hooks.reload(w13, w2), table, counts)

    def commit(self, new: PlacementMap, staged: _Staged) -> None:
        if staged.in_place is not None:
            index, new13, new2 = staged.in_place
            staged.w13.index_copy_(0, index, new13)
            staged.w2.index_copy_(0, index, new2)
        self.balancer.install(new, staged.w13, staged.w2, staged.table, staged.counts)
        self.hooks.commit(staged.experts, new)
