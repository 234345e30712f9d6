"""``EPMoE``: one dispatcher and one experts backend glued together, after checking they fit."""

from __future__ import annotations

import math
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from ep_runtime import dispatch as _dispatch_backends  # noqa: F401  (registers dispatchers)
from ep_runtime import experts as _experts_backends  # noqa: F401  (registers experts)
from ep_runtime.comm import Comm, PeerIdentity
from ep_runtime.config import MoEConfig
from ep_runtime.dispatch.base import (
    DISPATCHERS,
    Dispatcher,
    DispatchSetup,
    LayerIdentity,
    PeerSetup,
)
from ep_runtime.dispatch.cache import acquire_dispatcher, release_dispatcher
from ep_runtime.dispatch.protocol import fingerprint_of
from ep_runtime.experts.base import EXPERTS, Experts, ExpertsSetup, check_expert_weights
from ep_runtime.placement import ExpertPlacement
from ep_runtime.types import (
    BackendUnavailableError,
    ClosedError,
    Dispatched,
    DispatchMode,
    EPInputError,
    TopkLayout,
)
from ep_runtime.validation import check_forward_inputs

T = TypeVar("T")
PhaseTimer = Callable[[str, Callable[[], T]], T]  # (phase name, the phase's work) -> its result
PHASES = ("dispatch", "experts", "combine")


@dataclass(frozen=True)
class BackendChoice:
    """What was picked, what else could have run (and why it lost), and every refusal."""

    dispatcher: str
    experts: str
    layout: TopkLayout
    refused: dict[str, str] = field(default_factory=dict)  # "kind:name" -> reason
    passed_over: dict[str, str] = field(default_factory=dict)  # "kind:name" -> why not chosen

    def describe(self) -> str:
        lines = [f"dispatcher={self.dispatcher} experts={self.experts} layout={self.layout.value}"]
        lines += [f"  passed over {name}: {reason}" for name, reason in self.passed_over.items()]
        lines += [f"  refused {name}: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def _layouts_to_try(experts_cls: type[Experts], layout: TopkLayout | None) -> list[TopkLayout]:
    if layout is not None:
        return [layout]
    preferred = experts_cls.capabilities.preferred_layout
    return [preferred, *(x for x in TopkLayout if x != preferred)]


def _fit(
    experts_cls: type[Experts],
    dispatcher: str,
    layout: TopkLayout | None,
    dispatch_setup: DispatchSetup,
    experts_setup: ExpertsSetup,
) -> tuple[type[Dispatcher], TopkLayout] | str:
    """The first (dispatcher, layout) that ``experts_cls`` runs with, or why there is none."""
    reasons = []
    for candidate_layout in _layouts_to_try(experts_cls, layout):
        reason = experts_cls.refusal(experts_setup, candidate_layout)
        if reason is not None:
            reasons.append(f"layout {candidate_layout.value}: {reason}")
            continue
        for dispatcher_cls in DISPATCHERS.candidates(dispatcher):
            why = dispatcher_cls.refusal(dispatch_setup, candidate_layout)
            if why is None:
                return dispatcher_cls, candidate_layout
            reasons.append(f"{dispatcher_cls.name} ({candidate_layout.value}): {why}")
    return "no dispatcher fits: " + "; ".join(reasons)


def choose_backends(
    dispatcher: str,
    experts: str,
    layout: TopkLayout | None,
    dispatch_setup: DispatchSetup,
    experts_setup: ExpertsSetup,
) -> tuple[type[Dispatcher], type[Experts], BackendChoice]:
    """Pick (dispatcher, experts, layout): the highest-priority experts backend that runs here
    with some dispatcher, in its preferred layout if a dispatcher supports it. Every candidate
    gets a line in the choice: why it was refused, or why it lost although it could run."""
    refused: dict[str, str] = {}
    runnable: list[tuple[type[Experts], type[Dispatcher], TopkLayout]] = []
    for experts_cls in EXPERTS.candidates(experts):
        reason = experts_cls.refusal(experts_setup, None)
        if reason is None and experts == "auto":
            reason = experts_cls.auto_refusal(experts_setup)
        fit = (
            reason
            if reason is not None
            else _fit(experts_cls, dispatcher, layout, dispatch_setup, experts_setup)
        )
        if isinstance(fit, str):
            refused[f"experts:{experts_cls.name}"] = fit
        else:
            runnable.append((experts_cls, *fit))
    if not runnable:
        raise BackendUnavailableError(
            "experts+dispatcher", f"experts={experts}, dispatcher={dispatcher}", refused
        )
    experts_cls, dispatcher_cls, chosen_layout = runnable[0]
    passed_over = {
        f"experts:{other.name}": (
            f"runs here too; {experts_cls.name} ranks higher for 'auto' "
            f"(priority {experts_cls.auto_priority} > {other.auto_priority})"
        )
        for other, _, _ in runnable[1:]
    }
    for other in DISPATCHERS.candidates(dispatcher):
        if other is dispatcher_cls:
            continue
        why = other.refusal(dispatch_setup, chosen_layout)
        if why is not None:
            refused[f"dispatcher:{other.name}"] = why
        else:
            passed_over[f"dispatcher:{other.name}"] = (
                f"runs here too; {dispatcher_cls.name} ranks higher for 'auto' "
                f"(priority {dispatcher_cls.auto_priority} > {other.auto_priority})"
            )
    choice = BackendChoice(
        dispatcher_cls.name, experts_cls.name, chosen_layout, refused, passed_over
    )
    return dispatcher_cls, experts_cls, choice


@dataclass(frozen=True)
class _BuildReport:
    """What each rank contributes when a layer is built (one all-gather)."""

    settings: dict[str, str]
    choice: tuple[str, str, str] | str  # (dispatcher, experts, layout) or the refusal
    identity: PeerIdentity
    nonce: str


def agree_on_build(
    comm: Comm,
    settings: dict[str, str],
    chosen: tuple[type[Dispatcher], type[Experts], BackendChoice] | BackendUnavailableError,
) -> PeerSetup:
    """One all-gather: every rank must have the same settings and run the same backends (their
    collectives must match), or all raise, naming the setting (or choice) and the ranks."""
    summary = (
        chosen
        if isinstance(chosen, BackendUnavailableError)
        else (chosen[2].dispatcher, chosen[2].experts, chosen[2].layout.value)
    )
    own = _BuildReport(
        settings,
        summary if isinstance(summary, tuple) else f"no backend: {summary}",
        PeerIdentity.of_this_process(),
        uuid.uuid4().hex,
    )
    reports: list[_BuildReport] = comm.all_gather_object(own)  # type: ignore[assignment]
    for key in settings:
        values = [report.settings.get(key) for report in reports]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {rank} = {value}" for rank, value in enumerate(values))
            raise EPInputError(key, "the same value on every rank", per_rank)
    choices = [report.choice for report in reports]
    if any(isinstance(c, tuple) for c in choices) and len(set(map(str, choices))) > 1:
        per_rank = "\n".join(f"  rank {rank}: {c}" for rank, c in enumerate(choices))
        raise BackendUnavailableError(
            "experts+dispatcher",
            f"experts={settings['experts']}, dispatcher={settings['dispatcher']}",
            {"ranks disagree": f"every rank must run the same backends:\n{per_rank}"},
        )
    if isinstance(chosen, BackendUnavailableError):
        raise chosen
    return PeerSetup(
        namespace=f"ep_runtime/{reports[0].nonce}",
        identities=[report.identity for report in reports],
    )


def _checked_device(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise EPInputError("device", "a torch device such as 'cpu' or 'cuda:0'", device) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EPInputError(
            "device",
            f"a device this torch can use (torch {torch.__version__} has no usable CUDA)",
            device,
        )
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


class EPMoE(torch.nn.Module):
    """An expert-parallel MoE layer: route-free (ids and weights come in), forward only.

    ``group=None`` uses the default process group if initialised, else a world of 1. Rank r owns
    experts ``[r·L, (r+1)·L)``. In exact mode T may exceed the cap (processed in chunks); in
    capacity mode T must fit it and nothing syncs with the host.
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
    ) -> None:
        super().__init__()
        try:
            self.mode = DispatchMode(mode)
        except ValueError:
            raise EPInputError("mode", "'exact' or 'capacity'", mode) from None
        try:
            requested_layout = None if layout == "auto" else TopkLayout(layout)
        except ValueError:
            raise EPInputError("layout", "'auto', 'standard' or 'expanded'", layout) from None
        capacity = (
            config.max_tokens_per_rank if max_tokens_per_rank is None else max_tokens_per_rank
        )
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise EPInputError("max_tokens_per_rank", "a positive int", capacity)
        self.config = config
        self.comm = Comm.create(group, _checked_device(device))
        self.placement = ExpertPlacement(config.num_experts, self.comm.rank, self.comm.world_size)
        self.dtype = config.resolve_dtype(self.comm.device)
        self.max_tokens_per_rank = capacity
        self.poison = poison
        self.phase_timer: PhaseTimer | None = None  # the launcher times phases through this
        dispatch_setup = DispatchSetup(
            comm=self.comm,
            num_experts=config.num_experts,
            hidden_size=config.hidden_size,
            max_top_k=config.top_k,
            max_tokens_per_rank=capacity,
            dtype=self.dtype,
            mode=self.mode,
            poison=poison,
        )
        self.checks_on_device = dispatch_setup.checks_on_device
        experts_setup = ExpertsSetup(
            config, self.placement, self.comm.device, self.dtype, max_tokens_per_rank=capacity
        )
        try:
            chosen = choose_backends(
                dispatcher, experts, requested_layout, dispatch_setup, experts_setup
            )
        except BackendUnavailableError as error:
            chosen = error
        settings = {
            "num_experts": str(config.num_experts),
            "top_k": str(config.top_k),
            "hidden_size": str(config.hidden_size),
            "intermediate_size": str(config.intermediate_size),
            "activation": config.activation.value,
            "dtype": str(self.dtype),
            "mode": self.mode.value,
            "max_tokens_per_rank": str(capacity),
            "layout": "auto" if requested_layout is None else requested_layout.value,
            "dispatcher": dispatcher,
            "experts": experts,
            "poison": str(poison),
        }
        peer_setup = agree_on_build(self.comm, settings, chosen)
        assert not isinstance(chosen, BackendUnavailableError)
        dispatcher_cls, experts_cls, self.choice = chosen
        self.layout = self.choice.layout
        self.experts = experts_cls(experts_setup)
        self.dispatcher = acquire_dispatcher(dispatcher_cls, dispatch_setup, peer_setup)
        self.identity = LayerIdentity(fingerprint_of(settings), self.dispatcher.register_layer())
        self._closed = False
        self._weights_loaded = False
        self._warned_about_grad = False

    @property
    def device(self) -> torch.device:
        return self.comm.device

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Global ``[E, …]`` weights are sliced to this rank's shard; local ``[L, …]`` taken as is.
        Cast once to the compute dtype and handed to the experts backend for conversion."""
        self._check_open()
        num_local = self.placement.num_local_experts
        num_experts = self.config.num_experts
        if w13.dim() == 3 and w13.size(0) == num_experts and num_experts != num_local:
            start = self.placement.local_expert_offset
            w13, w2 = w13[start : start + num_local], w2[start : start + num_local]
        if w13.dim() != 3 or w13.size(0) != num_local:
            raise EPInputError(
                "w13", f"[E={num_experts}, ...] or [L={num_local}, ...] experts", list(w13.shape)
            )
        check_expert_weights(w13, w2, self.config, num_local)
        cast = {"device": self.device, "dtype": self.dtype}
        self.experts.load_weights(
            w13.detach().to(**cast).contiguous(), w2.detach().to(**cast).contiguous()
        )
        self._weights_loaded = True

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
        if out is None:
            out = torch.empty_like(x)
        if self.poison:
            out.fill_(float("nan"))
        num_tokens, cap = x.size(0), self.max_tokens_per_rank
        if self.mode is DispatchMode.CAPACITY:
            self._forward_chunk(x, topk_ids, topk_weights, out, 1, None)
            return out
        num_local_chunks = max(1, math.ceil(num_tokens / cap))
        chunk, num_chunks = 0, 1
        while chunk < num_chunks:
            rows = slice(min(chunk * cap, num_tokens), min((chunk + 1) * cap, num_tokens))
            num_chunks = self._forward_chunk(
                x[rows], topk_ids[rows], topk_weights[rows], out[rows], num_local_chunks, None
            )
            chunk += 1
        return out

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
                dtype=self.dtype,
                device=self.device,
                capacity=self.max_tokens_per_rank if self.mode is DispatchMode.CAPACITY else None,
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
        self._warn_if_grad(x=x, topk_weights=topk_weights)
        return None

    def _warn_if_grad(self, **tensors: torch.Tensor) -> None:
        needing = [name for name, tensor in tensors.items() if tensor.requires_grad]
        if needing and not self._warned_about_grad:
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
        in the experts still takes part in the combine, carrying its status."""
        dispatched, num_chunks = self._phase(
            "dispatch",
            lambda: self.dispatcher.dispatch(
                x,
                topk_ids,
                topk_weights,
                self.layout,
                layer=self.identity,
                num_local_chunks=num_local_chunks,
                failure=failure,
            ),
        )
        expert_output = None
        if failure is None:
            try:
                expert_output = self._phase("experts", lambda: self._experts(dispatched))
            except BaseException as error:  # the peers learn it through the combine
                failure = error
        self._phase(
            "combine",
            lambda: self.dispatcher.combine(expert_output, dispatched, out, failure=failure),
        )
        return num_chunks

    def _experts(self, dispatched: Dispatched) -> torch.Tensor:
        return self.experts.forward(dispatched)

    def _phase(self, name: str, work: Callable[[], T]) -> T:
        if self.phase_timer is None:
            return work()
        return self.phase_timer(name, work)

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
            f"mode={self.mode.value}, cap={self.max_tokens_per_rank}"
        )
