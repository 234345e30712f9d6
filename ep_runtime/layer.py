"""``EPMoE``: one dispatcher and one experts backend glued together, after checking they fit.

Options are checked into a ``LayerSpec`` (layer_spec.py), backends picked by ``selection.py``
and agreed by every rank in ``agreement.py``; this module runs the forward."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ep_runtime.agreement import agreed_backends
from ep_runtime.comm import Comm
from ep_runtime.config import MoEConfig
from ep_runtime.dispatch.cache import acquire_dispatcher, release_dispatcher
from ep_runtime.dispatch.protocol import LayerIdentity, fingerprint_of
from ep_runtime.elastic.rehome import WeightSource
from ep_runtime.eplb import ExpertBalancer, PlacementMap, RebalanceReport, WeightSet
from ep_runtime.eplb.transaction import ChangeHooks
from ep_runtime.experts.base import Experts, check_expert_weights
from ep_runtime.forward_graphs import DEFAULT_GRAPH_POLICY, ForwardGraphs, GraphPolicy
from ep_runtime.layer_spec import LayerSpec, checked_device
from ep_runtime.quantization import Fp8BlockWeights, check_weight_quantization
from ep_runtime.rounds import RoundBounds, bytes_per_token
from ep_runtime.types import (
    ClosedError,
    DispatchMode,
    EPInputError,
    TopkLayout,
)
from ep_runtime.validation import InputChecker

if TYPE_CHECKING:
    from ep_runtime.elastic.group import ElasticGroup

PhaseTimer = Callable[[str], AbstractContextManager[object]]  # a phase's name -> its timer
PHASES = ("dispatch", "experts", "combine")
_UNTIMED = contextlib.nullcontext()  # reusable: an untimed forward makes no object per phase


def _untimed(phase: str) -> AbstractContextManager[object]:
    """The ``PhaseTimer`` of an untimed forward."""
    return _UNTIMED


class EPMoE(torch.nn.Module):
    """An expert-parallel MoE layer: route-free (ids and weights come in), forward only.

    Parameters
    ----------
    config : MoEConfig
        Experts ``E``, the largest top-k ``K``, hidden ``H``, intermediate ``I``, activation,
        compute dtype (``None``: bf16 on CUDA, fp32 on CPU), quantization.
    group : torch.distributed.ProcessGroup, optional
        The EP group. ``None``: the default group if initialised, else a world of 1. Without
        redundancy rank r owns experts ``[r·L, (r+1)·L)``, ``L = E / W``.
    dispatcher, experts : str
        Backend names from the registries, or ``"auto"`` (``layer.choice.describe()`` says what
        was picked and why the others were refused).
    layout : TopkLayout or str
        ``"standard"`` (one row per (token, rank), ``[R, K]`` ids), ``"expanded"`` (one row per
        (token, local expert), ``[R, 1]`` ids) or ``"auto"``.
    mode : DispatchMode or str
        ``"exact"``: buffers sized to each forward (one host sync). ``"capacity"``: static
        shapes up to ``max_tokens_per_rank``, no host sync, CUDA-graph capturable.
    max_tokens_per_rank : int, optional
        Exact mode: a bound on the tokens of one round (``None``: none; the dispatcher's fixed
        buffers or, on CUDA, free memory may split a forward into rounds, agreed every forward;
        ep_runtime/rounds.py). Capacity mode: the static cap every forward's T must fit
        (default 256). The same on every rank (agreed at build).
    device : torch.device or str, optional
        Where the layer computes (``None``: the group's device).
    poison : bool
        Fill outputs with NaN before computing (tests: a row never written shows).
    num_redundant_experts : int
        ``R`` extra expert slots for load balancing (``E + R`` a multiple of ``W``;
        docs/eplb.md).
    eplb_interval : int, optional
        Rebalance automatically every this many forwards.
    device_checks : bool
        Exact mode at world size 1 on CUDA: check ids on the device (a bad one is dropped to -1
        and counted; ``check()`` raises) instead of one host read per forward. For ids that cannot
        be out of range (``route()``'s, an HF router's top-k); with peers it changes nothing.
    forward_graphs : GraphPolicy, optional
        Where a forward reads nothing on the host (CUDA, world size 1, capacity mode or
        ``device_checks``, capturable backends), eager forwards of a token count met before
        replay a CUDA graph of the forward (forward_graphs.py); ``None`` runs every forward eager.
    elastic : ElasticGroup, optional
        The group this layer shares with the process's other elastic layers (instead of
        ``group``): after a rank is lost, ``elastic.recover()`` (or the next forward) re-forms
        it from the survivors and re-homes the experts (docs/elastic.md).
    weight_source : callable, optional
        Elastic layers: ``source(expert_ids) -> (w13 [n, rows, H], w2 [n, H, I])`` for logical
        experts that no survivor holds after a loss (a checkpoint read, a seeded generator).

    Raises
    ------
    EPInputError
        A bad argument, naming it with the expected and given value; ranks that disagree on a
        setting all raise, naming it and each rank's value.
    BackendUnavailableError
        No backend can serve the setup (each refusal says why).
    """

    def __init__(
        self,
        config: MoEConfig,
        group: dist.ProcessGroup | None = None,
        dispatcher: str = "auto",
        experts: str = "auto",
        layout: TopkLayout | str = "auto",
        mode: DispatchMode | str = "exact",
        max_tokens_per_rank: int | None = None,
        *,
        device: torch.device | str | None = None,
        poison: bool = False,
        num_redundant_experts: int = 0,
        eplb_interval: int | None = None,
        device_checks: bool = False,
        forward_graphs: GraphPolicy | None = DEFAULT_GRAPH_POLICY,
        elastic: ElasticGroup | None = None,
        weight_source: WeightSource | None = None,
    ) -> None:
        super().__init__()
        if forward_graphs is not None and not isinstance(forward_graphs, GraphPolicy):
            raise EPInputError("forward_graphs", "a GraphPolicy or None", repr(forward_graphs))
        if elastic is not None and group is not None:
            raise EPInputError("group", "None where elastic= is given (it holds the group)", group)
        self.config = config
        self.elastic = elastic
        self.weight_source = weight_source
        self._graph_policy = forward_graphs
        comm = Comm.create(elastic.group if elastic is not None else group, checked_device(device))
        spec = LayerSpec.of(
            config,
            comm.device,
            dispatcher=dispatcher,
            experts=experts,
            layout=layout,
            mode=mode,
            max_tokens_per_rank=max_tokens_per_rank,
            poison=poison,
            num_redundant_experts=num_redundant_experts,
            eplb_interval=eplb_interval,
            device_checks=device_checks,
            elastic=elastic is not None,
        )
        self.phase_timer: PhaseTimer | None = None  # the launcher times each phase in a `with`
        self._build(comm, spec, None)
        self._closed = False
        if elastic is not None:
            elastic.register(self)

    def _build(self, comm: Comm, spec: LayerSpec, placement: PlacementMap | None) -> None:
        """Everything that depends on the group: balancer, backends (agreed by every rank),
        the shared dispatcher, round bounds, graphs. ``placement``: the balancer's first map
        (None: the initial one). Built again on a re-formed group (ep_runtime/elastic/)."""
        self.comm, self.spec = comm, spec
        self.eplb = ExpertBalancer(
            comm, spec.config.num_experts, spec.num_redundant_experts, spec.eplb_interval, placement
        )
        build = agreed_backends(comm, spec)
        self.choice, self.layout = build.choice, build.choice.layout
        self._new_experts = lambda: build.experts(build.experts_setup)
        self.experts = self._new_experts()
        self._left_group = False
        self.dispatcher = acquire_dispatcher(
            build.dispatcher, build.dispatch_setup, build.peer_setup
        )
        identities = build.peer_setup.identities
        self.eplb.bind(self.dispatcher.comm, [identity.host for identity in identities])
        self.identity = LayerIdentity(self._fingerprint(), self.dispatcher.register_layer())
        self.rounds = RoundBounds.of(  # exact mode's bounds on the tokens of one round
            spec.max_tokens_per_rank,
            self.dispatcher.max_round_tokens,
            bytes_per_token(spec.config, comm.world_size),
            comm.device,
        )
        self._weights_loaded = False
        # read by every forward: resolved once here
        self._capacity = spec.mode is DispatchMode.CAPACITY
        input_cap = spec.max_tokens_per_rank if self._capacity else None
        self._inputs = InputChecker(spec.config, spec.dtype, comm.device, input_cap)
        self.graphs = self._forward_graphs(self._graph_policy)

    def _rejoin(
        self, group: dist.ProcessGroup, placement: PlacementMap, w13: torch.Tensor, w2: torch.Tensor
    ) -> None:
        """Serve on a re-formed group (ep_runtime/elastic/) with ``placement`` and new slots."""
        self._leave_group()
        spec = dataclasses.replace(self.spec, num_redundant_experts=placement.num_redundant)
        try:
            self._build(Comm.create(group, self.device), spec, placement)
        except BaseException:
            if self.eplb.placement is placement:  # what it holds stays what its map says
                self.eplb.keep_weights(w13, w2, given=(w13, w2))
            raise
        self.load_weights(w13, w2, weights_are="slots")

    def _leave_group(self) -> None:
        """Let go of the dispatcher while its group exists (DeepEP's buffer goes before it)."""
        if not self._left_group:
            self._left_group = True
            release_dispatcher(self.dispatcher)

    def _forward_graphs(self, policy: GraphPolicy | None) -> ForwardGraphs | None:
        """The layer's CUDA graphs of its eager forwards, where nothing in them reads the host
        (releasing the workspace of the backend serving at the time: a rebalance may swap it)."""
        return ForwardGraphs.where_capturable(
            policy, self.dispatcher, self.experts, lambda: self.experts.release_workspace()
        )

    def _fingerprint(self) -> int:
        """What every forward header carries: the agreed settings and the placement, so a rank
        whose placement differs from its peers' is named at the next forward."""
        placement = self.eplb.placement.fingerprint()
        return fingerprint_of({"settings": self.spec.fingerprint(), "placement": placement})

    @property
    def mode(self) -> DispatchMode:
        return self.spec.mode

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the config's, or bf16 on CUDA and fp32 on CPU)."""
        return self.spec.dtype

    @property
    def max_tokens_per_rank(self) -> int | None:
        """Capacity mode: the cap on a forward's T. Exact mode: the user's bound on the tokens
        of one round (``None``: none; the layer's own bounds are in ``self.rounds``)."""
        return self.spec.max_tokens_per_rank

    @property
    def poison(self) -> bool:
        return self.spec.poison

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def placement(self) -> PlacementMap:
        return self.eplb.placement  # where every logical expert lives (the same on every rank)

    def load_weights(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        w13_scale_inv: torch.Tensor | None = None,
        w2_scale_inv: torch.Tensor | None = None,
        weights_are: WeightSet | str = "auto",
    ) -> None:
        """Give this rank its experts' weights (cast once to the compute dtype; fp8 stays e4m3).

        Parameters
        ----------
        w13 : torch.Tensor
            ``[E, 2I, H]`` (``"silu"``: rows ``[gate; up]``) or ``[E, I, H]`` (``"relu2"``), any
            float dtype: global weights, of which this rank keeps its slots' experts; or
            ``[S, ...]`` this rank's slot weights in slot order (without redundancy ``S = L``,
            the local shard). fp8 layers: ``torch.float8_e4m3fn``.
        w2 : torch.Tensor
            ``[E | S, H, I]``, as ``w13``.
        w13_scale_inv, w2_scale_inv : torch.Tensor, optional
            fp8 layers only: fp32 ``[E | S, 2I/128, H/128]`` and ``[E | S, H/128, I/128]`` block
            scales (the weight a block stands for is ``w.float() * scale_inv``).
        weights_are : WeightSet or str
            ``"auto"`` (``[E, ...]`` is global, ``[S, ...]`` slots), ``"global"`` or ``"slots"``
            (says which where ``S == E``).

        Raises
        ------
        EPInputError
            A shape, dtype or scale that does not fit, naming the argument.
        """
        self._check_open()
        slot13, slot2 = self.eplb.select_weights(w13, w2, weights_are)
        check_expert_weights(slot13, slot2, self.config, self.eplb.slots_per_rank)
        quantization = self.config.quantization
        if quantization is None:
            check_weight_quantization(None, slot13, slot2, w13_scale_inv, w2_scale_inv)
            cast = {"device": self.device, "dtype": self.dtype}
            slot13 = slot13.detach().to(**cast).contiguous()
            slot2 = slot2.detach().to(**cast).contiguous()
            self._drop_graphs()
            self.experts.load_weights(slot13, slot2)
            self.eplb.keep_weights(slot13, slot2, given=(w13, w2))
        else:
            scales = (w13_scale_inv, w2_scale_inv)
            if all(isinstance(scale, torch.Tensor) for scale in scales):
                scales = self.eplb.select_weights(*scales, weights_are)  # type: ignore[arg-type]
            check_weight_quantization(quantization, slot13, slot2, *scales)
            shard = Fp8BlockWeights(slot13, scales[0], slot2, scales[1])
            self._drop_graphs()
            self.experts.load_quantized_weights(shard.to(self.device))
        self._weights_loaded = True

    def _drop_graphs(self) -> None:
        if self.graphs is not None:  # they read the old weights
            self.graphs.clear()

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """``[E + R]`` int64 counts per slot over all ranks since the last reset (collective)."""
        self._check_open()
        return self.eplb.expert_load(reset)

    def rebalance(self, load: torch.Tensor | None = None) -> RebalanceReport:
        """New placement from ``load`` (None: the counts); collective (docs/eplb.md)."""
        self._check_open()
        if self.config.quantization is not None:
            raise EPInputError(
                "rebalance", "a layer with unquantized weights", self.config.quantization.value
            )
        return self.eplb.rebalance(load, self._change_hooks())

    def _change_hooks(self) -> ChangeHooks:
        """What a placement change (eplb/transaction.py) needs of this layer."""
        return ChangeHooks(
            comm=self.dispatcher.comm,
            in_place=type(self.experts).capabilities.serves_given_weights,
            open=lambda: self.dispatcher.open_placement_change(self.identity),
            reload=self._staged_experts,
            commit=self._serve_placement,
        )

    def _staged_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> Experts:
        """A new experts backend holding ``w13``/``w2``; the old one serves until the commit."""
        experts = self._new_experts()
        experts.load_weights(w13, w2)
        return experts

    def _serve_placement(self, experts: Experts | None, placement: PlacementMap) -> None:
        """A placement change's commit: the new backend (None: this rank's slots kept their
        experts) and the headers' fingerprint of the new placement."""
        if experts is not None:
            self._drop_graphs()
            self.experts = experts
        self.identity = LayerIdentity(self._fingerprint(), self.identity.index)

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,  # [T, H] compute dtype
        topk_ids: torch.Tensor,  # [T, K] int32/int64, -1 = unused
        topk_weights: torch.Tensor,  # [T, K] float32 (bf16 accepted)
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[t] = Σ_k topk_weights[t, k] · FFN_{topk_ids[t, k]}(x[t])`` over this rank's tokens.

        Collective: every rank of the group calls it (with its own tokens, possibly none).

        Parameters
        ----------
        x : torch.Tensor
            ``[T, H]`` in the compute dtype, on the layer's device: this rank's tokens.
        topk_ids : torch.Tensor
            ``[T, K]`` int32 or int64 expert ids, distinct per row; ``-1`` marks an unused slot
            (its weight is ignored, NaN included). ``K ≤ config.top_k``, the same on every rank.
        topk_weights : torch.Tensor
            ``[T, K]`` float32 (bf16 accepted): router weights, applied once.
        out : torch.Tensor, optional
            ``[T, H]`` like ``x``, written in place and returned.

        Returns
        -------
        torch.Tensor
            ``[T, H]`` in the compute dtype (sums in fp32, rounded once).

        Raises
        ------
        EPInputError
            Bad input on this rank (named, before any rank communicates).
        RemoteRankError
            Another rank failed (its rank and reason); ``ForwardMismatchError`` where ranks are
            not in the same forward of the same layer with the same placement.
        """
        self._check_open()
        failure = self._input_error(x, topk_ids, topk_weights, out)
        if failure is not None:  # every rank learns it in the first collective
            self._forward_chunk(x, topk_ids, topk_weights, None, 1, failure)
            raise failure
        topk_ids = self.eplb.to_physical(topk_ids)
        if out is None:
            out = torch.empty_like(x)
        if self.spec.poison:
            out.fill_(float("nan"))
        if self._capacity:
            self._forward_one_round(x, topk_ids, topk_weights, out)
            self.eplb.forward_done(self._change_hooks)
            return out
        num_tokens = x.size(0)
        per_round = self.rounds.tokens_per_round(num_tokens)
        num_local_rounds = max(1, -(-num_tokens // per_round))
        if num_local_rounds == 1:  # all at once; peers may still need more rounds
            num_rounds = self._forward_one_round(x, topk_ids, topk_weights, out)
            round_index = 1
        else:
            round_index, num_rounds = 0, 1
        while round_index < num_rounds:  # a rank needing fewer rounds sends empty ones
            start = min(round_index * per_round, num_tokens)
            rows = slice(start, min(start + per_round, num_tokens))
            num_rounds = self._forward_chunk(
                x[rows], topk_ids[rows], topk_weights[rows], out[rows], num_local_rounds, None
            )
            round_index += 1
        self.eplb.forward_done(self._change_hooks)
        return out

    def _forward_one_round(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> int:
        """A forward in one round (its chunk count, as ``_forward_chunk``): through the layer's
        CUDA graphs where they take it."""
        graphs = self.graphs
        if graphs is None or self.phase_timer is not None or not graphs.takes(x.size(0)):
            return self._forward_chunk(x, topk_ids, topk_weights, out, 1, None)
        graphs.run(lambda *io: self._forward_chunk(*io, 1, None), x, topk_ids, topk_weights, out)
        return 1  # a world of one

    def _input_error(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None
    ) -> BaseException | None:
        if not self._weights_loaded:
            return RuntimeError("EPMoE.load_weights() must be called before forward()")
        return self._inputs.error(x, ids, weights, out)

    def _forward_chunk(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None,
        num_local_chunks: int,
        failure: BaseException | None,
    ) -> int:
        """One dispatch → experts → combine round; returns the forward's chunk count. A failure
        in the experts still takes part in the combine, carrying its status. Each phase runs
        through ``phase_timer`` when one is set."""
        phases = self.phase_timer or _untimed
        with phases("dispatch"):
            dispatched, num_chunks = self.dispatcher.dispatch(
                x,
                topk_ids,
                topk_weights,
                self.layout,
                layer=self.identity,
                num_local_chunks=num_local_chunks,
                failure=failure,
                slot_load=self.eplb.slot_load,
            )
        expert_output = None
        if failure is None:
            try:
                with phases("experts"):
                    expert_output = self.experts.forward(dispatched)
            except BaseException as error:  # the peers learn it through the combine
                failure = error
        with phases("combine"):
            self.dispatcher.combine(expert_output, dispatched, out, failure=failure)
        return num_chunks

    def check(self) -> None:
        """Raise failures recorded on the device since the last check (capacity mode on CUDA:
        ids this rank dropped, and a peer's failure). One host sync."""
        self._check_open()
        self.dispatcher.take_recorded().raise_failures(self.config.num_experts)

    def close(self) -> None:
        """Release the shared dispatcher (its buffers go with the last user); peers waiting in
        this layer's forward are told."""
        if not self._closed:
            self._closed = True
            if not self._left_group:
                self.dispatcher.release_layer(self.identity.index)
            self._leave_group()

    def _check_open(self) -> None:
        """Refuse a closed layer; an elastic layer whose group lost a rank recovers first."""
        if self._closed:
            raise ClosedError(
                f"EPMoE (rank {self.comm.rank} of {self.comm.world_size}) used after close()"
            )
        if self.elastic is not None and self.elastic.needs_recovery():
            self.elastic.recover()

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"E={c.num_experts}, top_k={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
            f"rank={self.comm.rank}/{self.comm.world_size}, "
            f"{self.choice.describe().splitlines()[0]}, "
            f"mode={self.mode.value}, max_tokens_per_rank={self.max_tokens_per_rank}"
        )
