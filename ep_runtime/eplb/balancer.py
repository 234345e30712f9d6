"""One layer's expert load balancing: the placement, its device tables, the slot weights a
rank holds, load collection, and rebalancing (one placement-change transaction each:
eplb/transaction.py, docs/eplb.md)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch

from ep_runtime.comm import Comm
from ep_runtime.eplb.algorithm import node_count
from ep_runtime.eplb.device_map import DeviceMap
from ep_runtime.eplb.placement_map import PlacementMap
from ep_runtime.eplb.stats import RebalanceReport
from ep_runtime.eplb.transaction import ChangeHooks, PlacementChange
from ep_runtime.types import EPInputError


class WeightSet(Enum):
    """What ``load_weights`` is given: ``AUTO`` tells by the first dimension (``E``: global,
    also where ``S == E``; ``S``: slots), ``GLOBAL`` the logical ``[E, …]`` experts,
    ``SLOTS`` this rank's ``[S, …]`` slots in slot order."""

    AUTO = "auto"
    GLOBAL = "global"
    SLOTS = "slots"


class ExpertBalancer:
    """EPLB state of one ``EPMoE``; the layer calls it, it never calls the layer."""

    def __init__(
        self,
        comm: Comm,
        num_experts: int,
        num_redundant_experts: int,
        interval: int | None = None,
        placement: PlacementMap | None = None,
    ) -> None:
        if interval is not None and (
            not isinstance(interval, int) or isinstance(interval, bool) or interval < 1
        ):
            raise EPInputError("eplb_interval", "a positive int or None", interval)
        self.comm = comm
        self.placement = placement or PlacementMap.initial(
            num_experts, num_redundant_experts, comm.world_size
        )
        self.device_map = DeviceMap(self.placement, comm.device)
        self.interval = interval
        self.num_nodes = 1
        self.reports: list[RebalanceReport] = []
        self._forwards = 0
        self._w13: torch.Tensor | None = None  # [S, rows, H]
        self._w2: torch.Tensor | None = None  # [S, H, I]
        self.owns_weights = False  # the slot weights are not the caller's tensors

    def bind(self, comm: Comm, hosts: list[str]) -> None:
        """The comm its collectives go through (the dispatcher's, which watches the peers) and
        each rank's host, in rank order (the hierarchical form applies across nodes)."""
        self.comm = comm
        self.num_nodes = node_count(hosts)

    @property
    def slots_per_rank(self) -> int:
        return self.placement.slots_per_rank

    @property
    def local_experts(self) -> tuple[int, ...]:
        """The logical expert of each of this rank's slots."""
        return self.placement.experts_on_rank(self.comm.rank)

    @property
    def has_weights(self) -> bool:
        return self._w13 is not None and self._w2 is not None

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
        they share storage with the caller's tensors (``given``), a placement change writes new
        tensors instead of these."""
        self._w13, self._w2 = w13, w2
        self.owns_weights = not any(
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

    def forward_done(self, hooks: Callable[[], ChangeHooks]) -> RebalanceReport | None:
        """Count a completed forward; every ``interval`` forwards rebalance from the window."""
        self._forwards += 1
        if self.interval is None or self._forwards % self.interval:
            return None
        return self.rebalance(None, hooks())

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """``[E + R]`` int64 per-slot (token, slot) counts summed over ranks since the last
        reset. Collective."""
        total = self.device_map.take_load(reset)
        self.comm.all_reduce(total)
        return total

    def checked_load(self, load: torch.Tensor) -> torch.Tensor:
        """``[E]`` per-logical-expert load from ``load`` (``[E + R]`` per slot, as
        ``expert_load`` gives it, or ``[E]`` per logical expert)."""
        placement = self.placement
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

    def rebalance(self, load: torch.Tensor | None, hooks: ChangeHooks) -> RebalanceReport:
        """Compute a new placement from ``load`` (None: the counts since the last reset, summed
        over ranks), move the weights that change rank, switch every rank to the new map, and
        clear the counts. Collective; all ranks end on the new map or all raise, keeping the
        old one (eplb/transaction.py)."""
        report = PlacementChange(self, hooks).run(load)
        self.reports.append(report)
        return report

    def install(
        self,
        new: PlacementMap,
        w13: torch.Tensor,
        w2: torch.Tensor,
        table: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """A placement change's commit: the slot weights and device tables."""
        self.owns_weights = self.owns_weights or (w13 is not self._w13)
        self._w13, self._w2 = w13, w2
        self.placement = new
        self.device_map.install(new, table, counts)
