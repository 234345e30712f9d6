"""One layer's expert load balancing: the placement, its device tables, the slot weights a
rank holds, load collection, and the rebalance protocol every rank runs together.

Rebalance protocol (a fixed sequence of collectives, entered by every rank whatever happened
locally, so a failing rank cannot leave its peers waiting):
  1. all-reduce of the per-slot counts;
  2. all-gather of (status, fingerprint of the new map): all raise unless every rank computed
     the same map;
  3. one all-to-all of the slots that move between ranks (skipped when none does);
  4. all-gather of the staging status: all raise unless every rank holds its incoming weights;
  5. only then each rank writes the staged weights into its slots and switches the map.
A failure before step 5 leaves every rank on the old placement, with the old weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from ep_runtime.comm import Comm
from ep_runtime.eplb.algorithm import node_count, rebalanced_placement
from ep_runtime.eplb.device_map import DeviceMap
from ep_runtime.eplb.moves import (
    MovePlan,
    exchange,
    flat_rows,
    outgoing_slots,
    plan_moves,
    staged_weights,
)
from ep_runtime.eplb.placement_map import PlacementMap
from ep_runtime.eplb.stats import LoadStats, RebalanceReport
from ep_runtime.types import EPInputError, RemoteRankError


class WeightSet(Enum):
    """What ``load_weights`` is given: ``AUTO`` tells by the first dimension (``E``: global,
    also where ``S == E``; ``S``: slots), ``GLOBAL`` the logical ``[E, …]`` experts,
    ``SLOTS`` this rank's ``[S, …]`` slots in slot order."""

    AUTO = "auto"
    GLOBAL = "global"
    SLOTS = "slots"


Reload = Callable[[torch.Tensor, torch.Tensor], None]  # hands slot weights to the experts


@dataclass(frozen=True)
class _Status:
    error: str | None  # "Type: message" of this rank's failure
    fingerprint: str | None = None


class ExpertBalancer:
    """EPLB state of one ``EPMoE``; the layer calls it, it never calls the layer."""

    def __init__(
        self,
        comm: Comm,
        num_experts: int,
        num_redundant_experts: int,
        interval: int | None = None,
    ) -> None:
        if interval is not None and (
            not isinstance(interval, int) or isinstance(interval, bool) or interval < 1
        ):
            raise EPInputError("eplb_interval", "a positive int or None", interval)
        self.comm = comm
        self.placement = PlacementMap.initial(num_experts, num_redundant_experts, comm.world_size)
        self.device_map = DeviceMap(self.placement, comm.device)
        self.interval = interval
        self.num_nodes = 1
        self.reports: list[RebalanceReport] = []
        self._forwards = 0
        self._w13: torch.Tensor | None = None  # [S, rows, H]
        self._w2: torch.Tensor | None = None  # [S, H, I]
        self._owns_weights = False

    def bind_hosts(self, hosts: list[str]) -> None:
        """Each rank's host, in rank order: the hierarchical form applies across nodes."""
        self.num_nodes = node_count(hosts)

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank

    @property
    def local_experts(self) -> tuple[int, ...]:
        """The logical expert of each of this rank's slots."""
        return self.placement.experts_on_rank(self.comm.rank)

    @property
    def slot_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``w13 [S, rows, H]`` and ``w2 [S, H, I]``, in slot order."""
        if self._w13 is None or self._w2 is None:
            raise RuntimeError("EPMoE.load_weights() has not been called")
        return self._w13, self._w2

    def select_weights(
        self, w13: torch.Tensor, w2: torch.Tensor, weights_are: WeightSet | str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ``[E, …]`` weights → this rank's ``[S, …]`` slots (a view where the slots
        hold a contiguous run of experts, as without redundancy); ``[S, …]`` slot weights
        taken as they are, in slot order. ``weights_are="auto"`` reads ``[E, …]`` as global
        (also where ``S == E``) and ``[S, …]`` as slots; ``"global"`` or ``"slots"`` says
        which, and the first dimension must match it."""
        try:
            which = WeightSet(weights_are)
        except ValueError:
            names = ", ".join(repr(w.value) for w in WeightSet)
            raise EPInputError("weights_are", f"one of {names}", weights_are) from None
        num_experts, num_slots = self.placement.num_logical, self.slots_per_rank
        if w2.dim() != 3 or w2.size(0) != w13.size(0):
            raise EPInputError(
                "w2", f"[{w13.size(0)}, H, I] (as many experts as w13)", list(w2.shape)
            )
        rows = w13.size(0) if w13.dim() == 3 else None
        if which is not WeightSet.SLOTS and rows == num_experts:
            experts = self.local_experts
            if list(experts) == list(range(experts[0], experts[0] + num_slots)):
                start = experts[0]
                return w13[start : start + num_slots], w2[start : start + num_slots]
            index = torch.tensor(experts, dtype=torch.int64, device=w13.device)
            return w13.index_select(0, index), w2.index_select(0, index)
        if which is not WeightSet.GLOBAL and rows == num_slots:
            return w13, w2
        expected = {
            WeightSet.AUTO: f"[E={num_experts}, ...] global experts or [S={num_slots}, ...] "
            "this rank's slots",
            WeightSet.GLOBAL: f"[E={num_experts}, ...] global experts (weights_are='global')",
            WeightSet.SLOTS: f"[S={num_slots}, ...] this rank's slots (weights_are='slots')",
        }[which]
        raise EPInputError("w13", expected, list(w13.shape))

    def keep_weights(
        self, w13: torch.Tensor, w2: torch.Tensor, given: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Remember the slot weights handed to the experts (the source of every move). Where
        they share storage with the caller's tensors, the first rebalance copies them first."""
        self._w13, self._w2 = w13, w2
        self._owns_weights = not any(
            mine.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
            for mine, theirs in zip((w13, w2), given, strict=True)
        )

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Map ``[T, K]`` logical ids to physical slots (device only; no op at R = 0)."""
        return self.device_map.to_physical(topk_ids, seed=self.comm.rank)

    @property
    def slot_load(self) -> torch.Tensor:
        """``[E + R]`` int64 per-slot counts the dispatcher's route adds each forward's pairs to."""
        return self.device_map.load

    def forward_done(self, reload: Reload) -> RebalanceReport | None:
        """Count a completed forward; every ``interval`` forwards rebalance from the window."""
        self._forwards += 1
        if self.interval is None or self._forwards % self.interval:
            return None
        return self.rebalance(None, reload)

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """``[E + R]`` int64 per-slot (token, slot) counts summed over ranks since the last
        reset. Collective."""
        total = self.device_map.take_load(reset)
        self._all_reduce(total)
        return total

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.comm.group is not None:
            dist.all_reduce(tensor, group=self.comm.group)

    def _checked_load(self, load: torch.Tensor | None, measured: torch.Tensor) -> torch.Tensor:
        """``[E]`` per-logical-expert load from ``load`` (``[E + R]`` per slot, as
        ``expert_load`` gives it, or ``[E]`` per logical expert) or from the measured counts."""
        placement = self.placement
        if load is None:
            return placement.fold(measured.cpu())
        if not isinstance(load, torch.Tensor) or load.dim() != 1:
            raise EPInputError(
                "load",
                f"a 1-D tensor of {placement.num_physical} or {placement.num_logical}",
                load if not isinstance(load, torch.Tensor) else list(load.shape),
            )
        values = load.detach().double().cpu()
        if not bool(torch.isfinite(values).all() & (values >= 0).all()):
            raise EPInputError("load", "finite, non-negative values", values.tolist())
        if values.numel() == placement.num_physical:
            return placement.fold(values)
        if values.numel() == placement.num_logical:
            return values
        raise EPInputError(
            "load",
            f"[E + R = {placement.num_physical}] per slot or [E = {placement.num_logical}]",
            list(load.shape),
        )

    def rebalance(self, load: torch.Tensor | None, reload: Reload) -> RebalanceReport:
        """Compute a new placement from ``load`` (None: the counts since the last reset, summed
        over ranks), move the weights that change rank, switch every rank to the new map, and
        clear the counts. Collective; all ranks end on the new map or all raise."""
        start = time.perf_counter()
        failure: BaseException | None = None
        measured = self.device_map.take_load(reset=False)
        try:
            if self._w13 is None:
                raise RuntimeError("EPMoE.load_weights() must be called before rebalance()")
            checked = self._checked_load(load, measured) if load is not None else None
        except Exception as error:
            failure = error
        self._all_reduce(measured)  # 1
        plan = None
        if failure is None:
            try:
                logical = checked if checked is not None else self.placement.fold(measured.cpu())
                new = rebalanced_placement(logical, self.placement, num_nodes=self.num_nodes)
                plan = plan_moves(self.placement, new)
            except Exception as error:
                failure = error
        statuses = self._agree(failure, plan)  # 2
        assert plan is not None
        fingerprints = {s.fingerprint for s in statuses}
        if len(fingerprints) > 1:
            per_rank = ", ".join(f"rank {r} = {s.fingerprint}" for r, s in enumerate(statuses))
            raise EPInputError("load", "the same load on every rank (one placement)", per_rank)
        staged, failure = self._move(plan)  # 3
        self._agree(failure, plan)  # 4
        assert staged is not None
        self._install(plan.new, *staged, reload)  # 5
        size = self._w13[0].numel() + self._w2[0].numel()
        report = RebalanceReport(
            before=LoadStats.of_slots(measured, plan.old),
            after=LoadStats.predicted(logical, plan.new),
            changed_slots=len(plan.moves),
            local_copies=plan.num_local_copies,
            remote_slots=len(plan.remote),
            bytes_moved=len(plan.remote) * size * self._w13.element_size(),
            seconds=time.perf_counter() - start,
        )
        self.reports.append(report)
        return report

    def _move(
        self, plan: MovePlan
    ) -> tuple[tuple[list[int], torch.Tensor, torch.Tensor] | None, BaseException | None]:
        """Send and receive the remote slots (every rank takes part, a failed one with zeros)
        and stage every arriving slot's weights beside the old ones."""
        assert self._w13 is not None and self._w2 is not None
        rank = self.comm.rank
        width = self._w13[0].numel() + self._w2[0].numel()
        sources = outgoing_slots(plan, rank)
        failure = None
        try:
            send = flat_rows(self._w13, self._w2, sources)
        except Exception as error:
            failure = error
            send = self._w13.new_zeros(len(sources), width)
        received = exchange(plan, rank, self.comm.group, send, width)
        if failure is not None:
            return None, failure
        try:
            return self._staged(plan, received), None
        except Exception as error:
            return None, error

    def _staged(
        self, plan: MovePlan, received: torch.Tensor
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        assert self._w13 is not None and self._w2 is not None
        return staged_weights(plan, self.comm.rank, self._w13, self._w2, received)

    def _agree(self, failure: BaseException | None, plan: MovePlan | None) -> list[_Status]:
        """All-gather every rank's status; raise on every rank if one failed (that rank its
        own error, the others ``RemoteRankError`` naming it)."""
        own = _Status(
            None if failure is None else f"{type(failure).__name__}: {failure}",
            None if plan is None else plan.new.fingerprint(),
        )
        statuses: list[_Status] = self.comm.all_gather_object(own)  # type: ignore[assignment]
        if failure is not None:
            raise failure
        for rank, status in enumerate(statuses):
            if status.error is not None:
                raise RemoteRankError(rank, f"during rebalance: {status.error}")
        return statuses

    def _install(
        self,
        new: PlacementMap,
        slots: list[int],
        w13: torch.Tensor,
        w2: torch.Tensor,
        reload: Reload,
    ) -> None:
        """Write the staged slots in place and switch the map and its device tables."""
        assert self._w13 is not None and self._w2 is not None
        if not self._owns_weights:
            self._w13, self._w2 = self._w13.clone(), self._w2.clone()
            self._owns_weights = True
        if slots:
            index = torch.tensor(slots, dtype=torch.int64, device=self._w13.device)
            self._w13.index_copy_(0, index, w13)
            self._w2.index_copy_(0, index, w2)
        reload(self._w13, self._w2)
        self.placement = new
        self.device_map.update(new)
        self.device_map.load.zero_()
