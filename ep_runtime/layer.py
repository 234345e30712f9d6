"""``EPMoE``: one dispatcher and one experts backend glued together, after checking they fit.

Options are checked into a ``LayerSpec`` (layer_spec.py), backends picked by ``selection.py``
and agreed by every rank in ``agreement.py``; this module runs the forward."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from ep_runtime.agreement import agree_on_build
from ep_runtime.comm import Comm
from ep_runtime.config import MoEConfig
from ep_runtime.dispatch.cache import acquire_dispatcher, release_dispatcher
from ep_runtime.dispatch.protocol import LayerIdentity, fingerprint_of
from ep_runtime.eplb import ExpertBalancer, PlacementMap, RebalanceReport, WeightSet
from ep_runtime.eplb.transaction import ChangeHooks
from ep_runtime.experts.base import Experts, check_expert_weights
from ep_runtime.forward_graphs import DEFAULT_GRAPH_POLICY, ForwardGraphs, GraphPolicy
from ep_runtime.layer_spec import LayerSpec, checked_device
from ep_runtime.placement import ExpertPlacement
from ep_runtime.quantization import Fp8BlockWeights, check_weight_quantization
from ep_runtime.rounds import RoundBounds, bytes_per_token
from ep_runtime.selection import choose_backends
from ep_runtime.types import (
    BackendUnavailableError,
    ClosedError,
    DispatchMode,
    EPInputError,
    TopkLayout,
)
from ep_runtime.validation import check_forward_inputs

T = TypeVar("T")
PhaseTimer = Callable[[str, Callable[[], T]], T]  # (phase name, the phase's work) -> its result
PHASES = ("dispatch", "experts", "combine")


def _run_now(phase: str, work: Callable[[], T]) -> T:
    """The ``PhaseTimer`` of an untimed forward."""
    return work()


class EPMoE(torch.nn.Module):
    """An expert-parallel MoE layer: route-free (ids and weights come in), forward only.

    ``group=None`` uses the default process group if initialised, else a world of 1. Rank r owns
    experts ``[r·L, (r+1)·L)``.

    ``max_tokens_per_rank``: in exact mode (the default) buffers are sized to each forward,
    which runs as one round unless a bound splits it into rounds of at most ``b`` tokens: this
    argument (``None``, the default: none), the dispatcher's own (fixed-size buffers) or, on
    CUDA, what fits in free device memory (ep_runtime/rounds.py); ranks agree on the rounds in
    every forward. In capacity mode it is the static cap (default 256): T must fit it, buffers
    never change size, nothing syncs with the host and the forward can be a CUDA graph.

    ``device_checks=True``: in exact mode at world size 1 on CUDA, ids are checked on the device
    (a bad one is dropped to -1 and counted, and ``check()`` raises, as in capacity mode) instead of
    one host read at the end of every forward, so eager forwards do not wait for the GPU. For
    callers whose ids cannot be out of range (``route()``'s, an HF router's top-k); the
    transformers blocks set it.
    With peers, exact mode reads the headers on the host anyway and it changes nothing.

    ``forward_graphs``: where a forward reads nothing on the host (CUDA, world size 1, capacity
    mode or ``device_checks``, backends that declare it capturable), eager forwards of a token
    count met before replay a CUDA graph of the forward (forward_graphs.py; ``GraphPolicy``
    bounds the tokens and graphs); ``None`` runs every forward eager.
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
    ) -> None:
        super().__init__()
        if forward_graphs is not None and not isinstance(forward_graphs, GraphPolicy):
            raise EPInputError("forward_graphs", "a GraphPolicy or None", repr(forward_graphs))
        self.config = config
        self.comm = Comm.create(group, checked_device(device))
        self.spec = LayerSpec.of(
            config,
            self.comm.device,
            dispatcher=dispatcher,
            experts=experts,
            layout=layout,
            mode=mode,
            max_tokens_per_rank=max_tokens_per_rank,
            poison=poison,
            num_redundant_experts=num_redundant_experts,
            eplb_interval=eplb_interval,
            device_checks=device_checks,
        )
        if config.quantization is not None and (num_redundant_experts or eplb_interval):
            raise EPInputError(
                "num_redundant_experts",
                "0 and no eplb_interval with quantization='fp8_block' (rebalancing moves "
                "unquantized weights only, for now)",
                f"{num_redundant_experts} (eplb_interval={eplb_interval})",
            )
        self.eplb = ExpertBalancer(
            self.comm, config.num_experts, num_redundant_experts, eplb_interval
        )
        self.phase_timer: PhaseTimer | None = None  # the launcher times phases through this
        dispatch_setup = self.spec.dispatch_setup(self.comm)  # backends see physical slots
        slot_placement = ExpertPlacement(self.spec.num_slots, self.comm.rank, self.comm.world_size)
        experts_setup = self.spec.experts_setup(slot_placement, self.comm.device)
        try:
            chosen = choose_backends(
                self.spec.dispatcher,
                self.spec.experts,
                self.spec.layout,
                dispatch_setup,
                experts_setup,
            )
        except BackendUnavailableError as error:
            chosen = error
        peer_setup = agree_on_build(self.comm, self.spec, chosen)
        assert not isinstance(chosen, BackendUnavailableError)
        dispatcher_cls, experts_cls, self.choice = chosen
        self.layout = self.choice.layout
        self._new_experts = lambda: experts_cls(experts_setup)
        self.experts = self._new_experts()
        self.dispatcher = acquire_dispatcher(dispatcher_cls, dispatch_setup, peer_setup)
        self.eplb.bind(self.dispatcher.comm, [identity.host for identity in peer_setup.identities])
        self.identity = LayerIdentity(self._fingerprint(), self.dispatcher.register_layer())
        world = self.comm.world_size
        self.rounds = RoundBounds.of(  # exact mode's bounds on the tokens of one round
            self.spec.max_tokens_per_rank,
            self.dispatcher.max_round_tokens,
            bytes_per_token(
                config.hidden_size,
                config.intermediate_size,
                config.w13_rows,
                config.top_k,
                world,
                self.dtype,
            ),
            self.comm.device,
        )
        self._closed = False
        self._weights_loaded = False
        self._warned_about_grad = False
        # read by every forward: resolved once here
        self._capacity = self.spec.mode is DispatchMode.CAPACITY
        self._input_cap = self.spec.max_tokens_per_rank if self._capacity else None
        self.graphs = self._forward_graphs(forward_graphs)

    def _forward_graphs(self, policy: GraphPolicy | None) -> ForwardGraphs | None:
        """The layer's CUDA graphs of its eager forwards, where nothing in them reads the host."""
        checks = self.dispatcher.protocol.checks
        capturable = (
            type(self.dispatcher).capabilities.graph_capturable
            and type(self.experts).capabilities.graph_capturable
        )
        if policy is None or self.device.type != "cuda" or checks.peers or not checks.on_device:
            return None
        return ForwardGraphs(policy, self._release_workspace) if capturable else None

    def _release_workspace(self) -> None:
        self.experts.release_workspace()  # the backend serving now (a rebalance replaces it)

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
        """Global ``[E, …]`` weights (and fp8 block scales): this rank keeps its slots' experts;
        ``[S, …]`` slot weights (without redundancy, the ``[L, …]`` shard) taken as they are;
        ``weights_are`` ("auto", "global", "slots") says which where ``S == E`` ("auto" reads
        ``[E, …]`` as global). Cast once to the compute dtype (fp8 weights stay e4m3) and
        handed to the experts backend for conversion."""
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
        """``[T, H]``: Σ_k w[t,k]·FFN_{ids[t,k]}(x[t]). A failure on any rank fails every rank."""
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
        graphs.run(self._run_round, x, topk_ids, topk_weights, out)
        return 1  # a world of one

    def _run_round(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        self._forward_chunk(x, topk_ids, topk_weights, out, 1, None)

    def _input_error(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor | None,
    ) -> BaseException | None:
        try:
            if not self._weights_loaded:
                raise RuntimeError("EPMoE.load_weights() must be called before forward()")
            check_forward_inputs(
                x,
                topk_ids,
                topk_weights,
                config=self.config,
                dtype=self.spec.dtype,
                device=self.comm.device,
                capacity=self._input_cap,
            )
            if out is not None and (
                out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
            ):
                raise EPInputError(
                    "out",
                    f"shape {list(x.shape)}, dtype {x.dtype} on {x.device} (as x)",
                    f"shape {list(out.shape)}, dtype {out.dtype} on {out.device}",
                )
        except Exception as error:
            return error
        if not self._warned_about_grad and (x.requires_grad or topk_weights.requires_grad):
            self._warn_about_grad(x=x, topk_weights=topk_weights)
        return None

    def _warn_about_grad(self, **tensors: torch.Tensor) -> None:
        needing = [name for name, tensor in tensors.items() if tensor.requires_grad]
        if needing:
            self._warned_about_grad = True
            warnings.warn(
                f"EPMoE is forward-only (inference): {', '.join(needing)} requires grad, but no "
                "gradient flows through this layer; run it under torch.inference_mode() or "
                "torch.no_grad()",
                stacklevel=4,
            )

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
        run = self.phase_timer or _run_now
        dispatched, num_chunks = run(
            "dispatch",
            lambda: self.dispatcher.dispatch(
                x,
                topk_ids,
                topk_weights,
                self.layout,
                layer=self.identity,
                num_local_chunks=num_local_chunks,
                failure=failure,
                slot_load=self.eplb.slot_load,
            ),
        )
        expert_output = None
        if failure is None:
            try:
                expert_output = run("experts", lambda: self.experts.forward(dispatched))
            except BaseException as error:  # the peers learn it through the combine
                failure = error
        run(
            "combine",
            lambda: self.dispatcher.combine(expert_output, dispatched, out, failure=failure),
        )
        return num_chunks

    def check(self) -> None:
        """Raise failures recorded on the device since the last check (capacity mode on CUDA:
        ids this rank dropped, and a peer's failure). One host sync."""
        self._check_open()
        recorded = self.dispatcher.take_recorded()
        if recorded.bad_ids:
            raise EPInputError(
                "topk_ids",
                f"distinct values in [0, {self.config.num_experts}) or -1 per row",
                f"{recorded.bad_ids} out-of-range or repeated ids (replaced by -1)",
            )
        recorded.raise_peer_failure()

    def close(self) -> None:
        """Release the shared dispatcher (its buffers go with the last user); peers waiting in
        this layer's forward are told."""
        if not self._closed:
            self._closed = True
            self.dispatcher.release_layer(self.identity.index)
            release_dispatcher(self.dispatcher)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                f"EPMoE (rank {self.comm.rank} of {self.comm.world_size}) used after close()"
            )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"E={c.num_experts}, top_k={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
            f"rank={self.comm.rank}/{self.comm.world_size}, "
            f"{self.choice.describe().splitlines()[0]}, "
            f"mode={self.mode.value}, max_tokens_per_rank={self.max_tokens_per_rank}"
        )
