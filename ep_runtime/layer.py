"""``EPMoE``: one dispatcher and one experts backend glued together, after checking they fit."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ep_runtime import dispatch as _dispatch_backends  # noqa: F401  (registers dispatchers)
from ep_runtime import experts as _experts_backends  # noqa: F401  (registers experts)
from ep_runtime.comm import Comm
from ep_runtime.config import MoEConfig
from ep_runtime.dispatch.base import (
    DISPATCHERS,
    Dispatcher,
    DispatchSetup,
    acquire_dispatcher,
    release_dispatcher,
)
from ep_runtime.experts.base import EXPERTS, Experts, ExpertsSetup, check_expert_weights
from ep_runtime.placement import ExpertPlacement
from ep_runtime.types import (
    BackendUnavailableError,
    ClosedError,
    DispatchMode,
    EPInputError,
    TopkLayout,
)
from ep_runtime.validation import check_forward_inputs


@dataclass(frozen=True)
class BackendChoice:
    """What "auto" picked and why every other candidate was refused."""

    dispatcher: str
    experts: str
    layout: TopkLayout
    refused: dict[str, str] = field(default_factory=dict)  # "kind:name" -> reason

    def describe(self) -> str:
        lines = [f"dispatcher={self.dispatcher} experts={self.experts} layout={self.layout.value}"]
        lines += [f"  refused {name}: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def choose_backends(
    dispatcher: str,
    experts: str,
    layout: TopkLayout | None,
    dispatch_setup: DispatchSetup,
    experts_setup: ExpertsSetup,
) -> tuple[type[Dispatcher], type[Experts], BackendChoice]:
    """Pick (dispatcher, experts, layout). Layout "auto": the experts' preferred one if a
    dispatcher supports it, else another both support."""
    refused: dict[str, str] = {}
    for experts_cls in EXPERTS.candidates(experts):
        caps = experts_cls.capabilities
        layouts = (
            [layout]
            if layout is not None
            else [
                caps.preferred_layout,
                *(x for x in TopkLayout if x != caps.preferred_layout),
            ]
        )
        for candidate_layout in layouts:
            reason = experts_cls.refusal(experts_setup, candidate_layout)
            if reason is not None:
                refused.setdefault(f"experts:{experts_cls.name}", reason)
                continue
            dispatcher_refusals: dict[str, str] = {}
            for dispatcher_cls in DISPATCHERS.candidates(dispatcher):
                why = dispatcher_cls.refusal(dispatch_setup, candidate_layout)
                if why is None:
                    refused.pop(f"experts:{experts_cls.name}", None)
                    for name, text in dispatcher_refusals.items():
                        refused[f"dispatcher:{name}"] = text
                    choice = BackendChoice(
                        dispatcher_cls.name, experts_cls.name, candidate_layout, refused
                    )
                    return dispatcher_cls, experts_cls, choice
                dispatcher_refusals[dispatcher_cls.name] = why
            summary = "; ".join(f"{n}: {r}" for n, r in dispatcher_refusals.items())
            refused[f"experts:{experts_cls.name}"] = (
                f"no dispatcher for layout {candidate_layout.value} ({summary})"
            )
    raise BackendUnavailableError(
        "experts+dispatcher", f"experts={experts}, dispatcher={dispatcher}", refused
    )


def agree_on_backends(
    comm: Comm,
    dispatcher: str,
    experts: str,
    layout: TopkLayout | None,
    dispatch_setup: DispatchSetup,
    experts_setup: ExpertsSetup,
) -> tuple[type[Dispatcher], type[Experts], BackendChoice]:
    """``choose_backends`` on every rank, then one all-gather so that all ranks run the same
    pair (their collectives must match) or all raise, naming the ranks that differ."""
    refusal: BackendUnavailableError | None = None
    try:
        chosen = choose_backends(dispatcher, experts, layout, dispatch_setup, experts_setup)
        summary = (chosen[2].dispatcher, chosen[2].experts, chosen[2].layout.value)
    except BackendUnavailableError as error:
        refusal, summary = error, f"no backend: {error}"
    if comm.world_size > 1:
        summaries = comm.all_gather_object(summary)
        chosen_somewhere = any(isinstance(s, tuple) for s in summaries)
        if chosen_somewhere and len(set(map(str, summaries))) > 1:
            per_rank = "\n".join(f"  rank {rank}: {s}" for rank, s in enumerate(summaries))
            raise BackendUnavailableError(
                "experts+dispatcher",
                f"experts={experts}, dispatcher={dispatcher}",
                {"ranks disagree": f"every rank must run the same backends:\n{per_rank}"},
            )
    if refusal is not None:
        raise refusal
    return chosen


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
        if not isinstance(capacity, int) or capacity < 1:
            raise EPInputError("max_tokens_per_rank", "a positive int", capacity)
        self.config = config
        self.comm = Comm.create(group, None if device is None else torch.device(device))
        self.placement = ExpertPlacement(config.num_experts, self.comm.rank, self.comm.world_size)
        self.dtype = config.resolve_dtype(self.comm.device)
        self.max_tokens_per_rank = capacity
        self.poison = poison
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
        experts_setup = ExpertsSetup(
            config,
            self.placement,
            self.comm.device,
            self.dtype,
            max_tokens_per_rank=capacity,
            requested_by_name=experts != "auto",
        )
        dispatcher_cls, experts_cls, self.choice = agree_on_backends(
            self.comm, dispatcher, experts, requested_layout, dispatch_setup, experts_setup
        )
        self.layout = self.choice.layout
        self.experts = experts_cls(experts_setup)
        self.dispatcher = acquire_dispatcher(dispatcher_cls, dispatch_setup)
        self._closed = False
        self._weights_loaded = False
        # device-side count of out-of-range or repeated ids replaced by -1 (capacity mode on CUDA)
        self._bad_id_count = torch.zeros((), dtype=torch.int64, device=self.comm.device)

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def checks_values(self) -> bool:
        """Id range/duplicate checks need the data on the host: exact mode, or CPU."""
        return self.mode is DispatchMode.EXACT or self.device.type == "cpu"

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
        self.experts.load_weights(w13.to(**cast).contiguous(), w2.to(**cast).contiguous())
        self._weights_loaded = True

    def forward(
        self,
        x: torch.Tensor,  # [T, H] compute dtype
        topk_ids: torch.Tensor,  # [T, K] int32/int64, -1 = unused
        topk_weights: torch.Tensor,  # [T, K] float32 (bf16 accepted)
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, H]``: Σ_k w[t,k]·FFN_{ids[t,k]}(x[t]). Bad input on any rank fails every rank."""
        self._check_open()
        capacity_mode = self.mode is DispatchMode.CAPACITY
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
                capacity=self.max_tokens_per_rank if capacity_mode else None,
                check_values=self.checks_values,
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
            self.dispatcher.abort(error, self.layout)
        topk_weights = topk_weights.float()
        if not self.checks_values:
            topk_ids = self._drop_invalid_ids(topk_ids)
        num_tokens = x.size(0)
        if out is None:
            out = torch.empty_like(x)
        if self.poison:
            out.fill_(float("nan"))
        if capacity_mode:
            self._forward_chunk(x, topk_ids, topk_weights, out, num_local_chunks=1)
            return out
        cap = self.max_tokens_per_rank
        num_local_chunks = max(1, math.ceil(num_tokens / cap))
        chunk, num_chunks = 0, 1
        while chunk < num_chunks:
            rows = slice(min(chunk * cap, num_tokens), min((chunk + 1) * cap, num_tokens))
            num_chunks = self._forward_chunk(
                x[rows], topk_ids[rows], topk_weights[rows], out[rows], num_local_chunks
            )
            chunk += 1
        return out

    def _forward_chunk(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: torch.Tensor,
        num_local_chunks: int,
    ) -> int:
        dispatched = self.dispatcher.dispatch(
            x, topk_ids, topk_weights, self.layout, num_local_chunks=num_local_chunks
        )
        expert_output = self.experts.forward(dispatched)
        self.dispatcher.combine(expert_output, dispatched, out=out)
        return dispatched.num_chunks

    def _drop_invalid_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Capacity mode on CUDA: out-of-range ids and repeats within a row become -1 and are
        counted on the device (no sync). Repeats must go: buffers are sized for ≤ min(K, L)
        served slots per row."""
        out_of_range = (topk_ids < -1) | (topk_ids >= self.config.num_experts)
        ids = topk_ids.masked_fill(out_of_range, -1)
        ordered, order = ids.sort(dim=1, stable=True)
        repeat_sorted = torch.zeros_like(out_of_range)
        repeat_sorted[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        repeated = torch.zeros_like(out_of_range).scatter_(1, order, repeat_sorted)
        self._bad_id_count += out_of_range.sum() + repeated.sum()
        return ids.masked_fill(repeated, -1)

    def check(self) -> None:
        """Raise errors recorded on the device since the last check (one host sync)."""
        self._check_open()
        bad = int(self._bad_id_count)
        if bad:
            self._bad_id_count.zero_()
            raise EPInputError(
                "topk_ids",
                f"distinct values in [0, {self.config.num_experts}) or -1 per row",
                f"{bad} out-of-range or repeated ids (replaced by -1)",
            )
        self.dispatcher.check()

    def close(self) -> None:
        """Release the shared dispatcher (its buffers go with the last user)."""
        if not self._closed:
            self._closed = True
            release_dispatcher(self.dispatcher)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("EPMoE used after close()")

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"E={c.num_experts}, top_k={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
            f"rank={self.comm.rank}/{self.comm.world_size}, "
            f"{self.choice.describe().splitlines()[0]}, "
            f"mode={self.mode.value}, cap={self.max_tokens_per_rank}"
        )
