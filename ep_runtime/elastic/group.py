"""``ElasticGroup``: the EP group a process's elastic layers share, which outlives its ranks.

It forms torch.distributed's default group itself, on a store that no rank process holds (the
launcher's), one generation at a time. When a rank is lost, the survivors' forward fails on
every one of them (a named ``RemoteRankError``, as for any layer) and the group is marked for
recovery. ``recover()`` (also run by the next forward or rebalance of any of its layers):

  1. members: the survivors agree through the store who is in the next generation
     (elastic/membership.py; a rank not in the list raises ``CountedOutError``);
  2. re-form: the old group is let go and a new default group of the members formed, with new
     ranks numbered densely in the order of the original ranks;
  3. re-home, for every registered layer in order: what each survivor holds is shared, the new
     placement computed by EPLB from the load counted before the loss, replicas moved, missing
     experts read from the layer's weight source (elastic/rehome.py);
  4. a vote through the store: every survivor re-homed every layer, or none commits (a death
     during the recovery starts it again one generation on, while time is left);
  5. commit: each layer is built again on the new group with its new placement and weights.

A run's ranks must build the same elastic layers in the same order (their rebuild is
collective, as their construction was).
"""

from __future__ import annotations

import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ep_runtime import comm_process
from ep_runtime.comm import Comm, PeerIdentity
from ep_runtime.comm_notices import NoticeBoard
from ep_runtime.elastic.membership import (
    DEFAULT_JOIN_WINDOW_S,
    CountedOutError,
    Membership,
    agree_members,
)
from ep_runtime.elastic.rehome import (
    Holding,
    RehomePlan,
    exchange_and_assemble,
    plan_rehome,
    read_from_source,
)
from ep_runtime.elastic.report import LayerRecovery, Recovery
from ep_runtime.eplb.placement_map import PlacementMap
from ep_runtime.eplb.stats import LoadStats
from ep_runtime.types import EPInputError, GroupUnusableError

if TYPE_CHECKING:
    from ep_runtime.config import MoEConfig
    from ep_runtime.dispatch.base import Dispatcher
    from ep_runtime.elastic.rehome import WeightSource
    from ep_runtime.eplb import ExpertBalancer
    from ep_runtime.layer_spec import LayerSpec


class ElasticMember(Protocol):
    """What a recovery reads and calls of a layer built on the group (``EPMoE``)."""

    config: MoEConfig
    spec: LayerSpec
    eplb: ExpertBalancer
    dispatcher: Dispatcher
    weight_source: WeightSource | None
    _closed: bool

    def _leave_group(self) -> None: ...

    def _rejoin(
        self, group: dist.ProcessGroup, placement: PlacementMap, w13: torch.Tensor, w2: torch.Tensor
    ) -> None: ...


FORM_TIMEOUT_S = 10.0  # forming a generation's group: a member that died meanwhile fails it
RECOVERY_BUDGET_S = 30.0  # attempts (a death during a recovery) start only within this
POLL_S = 0.02


class RecoveryError(GroupUnusableError):
    """A recovery that could not complete on the survivors; the reason is named."""


class ElasticGroup:
    """The default process group of ``world_size`` ranks, formed on ``store`` and re-formed
    from the survivors after a rank loss.

    Parameters
    ----------
    store : torch.distributed.Store
        The run's rendezvous store, hosted outside every rank process (the launcher's).
    rank, world_size : int
        This process's original rank and the original world size.
    device : torch.device or str, optional
        The device the layers compute on (NCCL on CUDA, gloo on CPU); ``None``: the current
        CUDA device if there is one, else CPU.
    timeout_s : float
        The group's collective timeout (every generation).
    join_window_s : float
        Membership: how long after the first survivor joins the list closes without ranks
        that are not known to be gone (their process on this host ended).

    Raises
    ------
    EPInputError
        torch.distributed is already initialised (the group forms it), or a bad argument.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        device: torch.device | str | None = None,
        timeout_s: float = 60.0,
        join_window_s: float = DEFAULT_JOIN_WINDOW_S,
    ) -> None:
        if dist.is_initialized():
            raise EPInputError(
                "torch.distributed", "not initialised (ElasticGroup forms the group)", "initialised"
            )
        if not 0 <= rank < world_size:
            raise EPInputError("rank", f"in [0, {world_size})", rank)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.store = store
        self.original_rank = rank
        self.timeout_s = timeout_s
        self.join_window_s = join_window_s
        self.generation = 0
        self.members: tuple[int, ...] = tuple(range(world_size))
        self.serving = self.members  # the members the layers were last built on
        self.recoveries: list[Recovery] = []
        self._layers: list[weakref.ref[ElasticMember]] = []
        self._failure: BaseException | None = None  # a recovery that failed to commit
        self._recovering = False
        self._attempted = 0  # the last generation any recovery tried to form
        self._identities: dict[int, PeerIdentity] = {}
        self._form(Membership(0, self.members, ()))

    # ----------------------------------------------------------------- the group
    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    @property
    def rank(self) -> int:
        return self.members.index(self.original_rank)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def register(self, layer: ElasticMember) -> None:
        """A layer built on this group; recoveries rebuild it (in registration order)."""
        self._layers.append(weakref.ref(layer))

    def layers(self) -> list[ElasticMember]:
        """The registered layers still open, in registration order."""
        alive = [ref() for ref in self._layers]
        return [layer for layer in alive if layer is not None and not layer._closed]

    def needs_recovery(self) -> bool:
        """A layer's group is out of step (a peer was lost), or a recovery did not finish."""
        if self._recovering:
            return False
        if self._failure is not None:
            return True
        return any(layer.dispatcher.comm.unusable_reason for layer in self.layers())

    def _form(self, membership: Membership) -> None:
        """The default group of ``membership``'s members (this process's rank: its index)."""
        if dist.is_initialized():
            dist.destroy_process_group()  # the old group was aborted when the loss was seen
        prefix = dist.PrefixStore(f"elastic/gen{membership.generation}/group", self.store)
        options: dict = {
            "backend": "nccl" if self.device.type == "cuda" else "gloo",
            "store": prefix,
            "rank": membership.new_rank(self.original_rank),
            "world_size": len(membership.members),
            "timeout": timedelta(seconds=min(FORM_TIMEOUT_S, self.timeout_s)),
        }
        if self.device.type == "cuda":
            options["device_id"] = self.device
        dist.init_process_group(**options)
        identities = [PeerIdentity.of_this_process()] * len(membership.members)
        dist.all_gather_object(identities, PeerIdentity.of_this_process())
        distributed_c10d._set_pg_timeout(timedelta(seconds=self.timeout_s))
        self.generation, self.members = membership.generation, membership.members
        self._identities.update(zip(membership.members, identities, strict=True))

    def _is_gone(self, original_rank: int) -> bool:
        """Whether ``original_rank``'s process is known to have ended (on this host)."""
        identity = self._identities.get(original_rank)
        if identity is None or identity.host != PeerIdentity.of_this_process().host:
            return False
        return comm_process.process_is_gone(identity.pid)

    # ----------------------------------------------------------------- recovery
    def recover(self) -> Recovery:
        """Re-form the group from the survivors and re-home every registered layer (see the
        module's docstring). Collective over the survivors.

        Returns
        -------
        Recovery
            Who was lost, each step's time, where every layer's slots came from, the balance.

        Raises
        ------
        CountedOutError
            This rank joined after the survivors were agreed: it is not in the group.
        LostExpertsError
            Experts no survivor holds and no weight source supplies (every survivor raises it).
        RecoveryError
            The recovery failed on a survivor (named), or deaths outlasted its time budget.
        """
        self._recovering = True
        try:
            return self._recover()
        except BaseException as error:  # the layers left their group: the next call recovers
            self._failure = error
            raise
        finally:
            self._recovering = False

    def _recover(self) -> Recovery:
        start = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            self._attempted += 1  # never a generation tried before: its list may be stale
            membership = agree_members(
                self.store,
                self._attempted,
                self.original_rank,
                self.members,
                self._is_gone,
                self.join_window_s,
                self.timeout_s,
            )
            members_s = time.monotonic() - start
            for layer in self.layers():  # buffers go before the group they were made on
                layer._leave_group()
            try:
                self._form(membership)
            except Exception as error:  # a member died before the group formed
                self._retry_or_raise(start, f"forming generation {membership.generation}", error)
                continue
            reform_s = time.monotonic() - start - members_s
            comm = Comm.create(None, self.device).watched(
                f"elastic/gen{self.generation}/watch",
                [self._identities[member] for member in self.members],
            )
            staged, verdict = self._rehome(comm, self.serving)
            rehome_s = time.monotonic() - start - members_s - reform_s
            votes, someone_gone = self._vote(verdict)
            comm.close()
            failed = [(rank, v) for rank, v in enumerate(votes) if v is not None]
            if failed and not someone_gone:  # nothing a retry changes: all raise
                if isinstance(staged, BaseException):
                    raise staged
                rank, reason = failed[0]
                raise RecoveryError(f"re-homing failed on rank {rank}: {reason}")
            if failed:
                rank, reason = failed[0]
                self._retry_or_raise(start, f"re-homing (rank {rank}: {reason})", None)
                continue
            assert isinstance(staged, list)
            lost = tuple(r for r in self.serving if r not in self.members)
            self._commit(staged)
            recovery = Recovery(
                generation=self.generation,
                lost=lost,
                members=self.members,
                attempts=attempts,
                members_s=members_s,
                reform_s=reform_s,
                rehome_s=rehome_s,
                rebuild_s=time.monotonic() - start - members_s - reform_s - rehome_s,
                layers=tuple(layer for _, _, _, layer in staged),
            )
            self.recoveries.append(recovery)
            return recovery

    def _retry_or_raise(self, start: float, step: str, error: BaseException | None) -> None:
        if isinstance(error, CountedOutError):
            raise error
        if time.monotonic() - start > RECOVERY_BUDGET_S:
            raise RecoveryError(
                f"recovery gave up after {RECOVERY_BUDGET_S:.0f} s: {step} failed"
            ) from error

    def _rehome(
        self, comm: Comm, previous: tuple[int, ...]
    ) -> tuple[list | BaseException, str | None]:
        """Every layer's new placement and this rank's new slot weights (nothing serves them
        yet): ``([(layer, plan, (w13, w2), report)], None)``, or ``(error, why)``."""
        try:
            layers = self.layers()
            mine = [_holding(layer) for layer in layers]
            holdings = comm.all_gather_object(mine)
            if len({len(h) for h in holdings}) != 1:
                counts = [len(h) for h in holdings]
                raise EPInputError("elastic layers", "the same number on every survivor", counts)
            staged = []
            for index, layer in enumerate(layers):
                per_rank = [h[index] for h in holdings]
                plan = plan_rehome(index, per_rank, layer.spec.num_redundant_experts)
                w13, w2 = layer.eplb.slot_weights
                read = read_from_source(plan, comm.rank, layer.weight_source, w13)
                weights = exchange_and_assemble(comm, plan, w13, w2, read)
                lost = tuple(r for r in previous if r not in self.members)
                report = _layer_report(index, layer, plan, lost, previous)
                staged.append((layer, plan, weights, report))
            return staged, None
        except Exception as error:
            return error, f"{type(error).__name__}: {error}"

    def _vote(self, verdict: str | None) -> tuple[list[str | None], bool]:
        """Every member's verdict on this generation's re-homing, through the store, and whether
        a member is gone without voting (which fails it; one gone after counts with its vote)."""
        board = NoticeBoard(f"elastic/gen{self.generation}", self.store, ())
        board.cast_vote("rehome", self.rank, verdict)
        deadline = time.monotonic() + self.timeout_s
        while (votes := board.votes("rehome", self.world_size)) is None:
            for rank, member in enumerate(self.members):
                if not board.has_voted("rehome", rank) and self._is_gone(member):
                    reason = f"rank {rank} (original {member}) is gone"
                    return board.votes_so_far("rehome", self.world_size, rank, reason), True
            if time.monotonic() > deadline:
                raise RecoveryError(f"a survivor did not vote within {self.timeout_s:.0f} s")
            time.sleep(POLL_S)
        return votes, False

    def _commit(self, staged: list) -> None:
        """Every layer built on the new group; a failure here leaves the group marked for the
        next recovery (each layer's holdings stay coherent: old or new, never half)."""
        self._failure = None
        try:
            for layer, plan, (w13, w2), _ in staged:
                layer._rejoin(self.group, plan.placement, w13, w2)
        except BaseException as error:
            self._failure = error
            raise
        self.serving = self.members


def _holding(layer: ElasticMember) -> Holding:
    balancer = layer.eplb
    config = layer.config
    experts = balancer.local_experts if balancer.has_weights else ()
    load = balancer.placement.fold(balancer.slot_load.detach().cpu().double())
    shape = (config.num_experts, config.w13_rows, config.hidden_size, config.intermediate_size)
    return Holding(shape, tuple(experts), tuple(load.tolist()), layer.weight_source is not None)


def _layer_report(
    index: int,
    layer: ElasticMember,
    plan: RehomePlan,
    lost: tuple[int, ...],
    previous: tuple[int, ...],
) -> LayerRecovery:
    """``lost``: original ranks of ``previous`` (the lost group's members, by its ranks) left
    out; their experts came back from replicas or the weight source."""
    load = torch.tensor(plan.load, dtype=torch.float64)
    old: PlacementMap = layer.eplb.placement
    on_lost = {e for rank in lost for e in old.experts_on_rank(previous.index(rank))}
    on_survivors = {
        e
        for rank, member in enumerate(previous)
        if member not in lost
        for e in old.experts_on_rank(rank)
    }
    return LayerRecovery(
        layer=index,
        origins=plan.counts(),
        from_replicas=tuple(sorted(on_lost & on_survivors)),
        from_source=tuple(sorted(on_lost - on_survivors)),
        before=LoadStats.predicted(load, old),
        after=LoadStats.predicted(load, plan.placement),
        placement=plan.placement.fingerprint(),
    )
