"""Lockstep greedy generation on a patched model: every rank stays in every MoE collective until all
ranks are done (a rank with no request, or a finished one, runs each MoE block on zero tokens),
and the wall time spent inside the EP blocks. On an elastic model a step that fails because a rank
was lost is undone (what it added to the KV cache cropped, layer by layer) and run again by the
survivors once their group has recovered: their requests end with the tokens they would have had;
the lost rank's request is not served."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ep_runtime.integrations.transformers.report import PatchReport
from ep_runtime.types import EPInputError, RemoteRankError

if TYPE_CHECKING:
    from ep_runtime.elastic import Recovery


@dataclass
class GreedyResult:
    """One rank's request: its tokens and logits, where the time went, and (on an elastic
    model) the recoveries it went through."""

    tokens: list[int]  # generated ids; the EOS that ended the request is included
    logits: torch.Tensor  # [N, V] float32 on CPU: the logits each token was chosen from
    steps: int  # lockstep steps of the whole group (the same on every rank)
    idle_steps: int  # steps this rank ran every MoE block on zero tokens
    prefill_s: float  # this rank's first forward (0 without a request)
    active_s: float  # first step to this rank's last token (0 without a request)
    total_s: float  # first step to the group's last
    moe_s: float  # inside the EP blocks (router, dispatch, experts, combine, shared experts)
    recoveries: tuple[Recovery, ...] = ()  # the elastic group's recoveries during the request
    retried_steps: int = 0  # steps this rank started again after a recovery

    @property
    def lost_ranks(self) -> tuple[int, ...]:
        """The original ranks lost during the request (their requests were not served)."""
        return tuple(rank for recovery in self.recoveries for rank in recovery.lost)


def greedy_generate(
    model: nn.Module,
    report: PatchReport,
    prompt: Sequence[int] | torch.Tensor | None,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    time_moe: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> GreedyResult:
    """Greedy decoding of one request (``prompt``: token ids; ``None`` or empty: no request), in
    lockstep with the other ranks: each step all ranks agree (one tiny all-reduce) whether anyone
    still generates; a rank with nothing to run runs every MoE block on zero tokens instead, so
    every MoE collective has all ranks in it. Prompt and generation lengths may differ per rank.
    ``on_step(step)`` runs after each lockstep step on every rank, at the same point everywhere
    (so it may call collectives, such as each EP layer's ``rebalance()``).

    On an elastic model (``patch_moe_blocks(elastic=...)``), a step in which a rank is lost
    raises ``RemoteRankError`` on the survivors; each undoes what the step added (its KV-cache
    entries, per layer), the group recovers (``ElasticGroup.recover``), the survivors agree on
    the steps they all completed (one that a survivor finished while another failed in it is
    undone there too) and run the next one again, ``on_step`` included.

    Parameters
    ----------
    model : torch.nn.Module
        The model ``patch_moe_blocks`` patched; called with ``input_ids [1, P]`` (then
        ``[1, 1]``), ``cache`` and ``use_cache=True``; its output's ``logits`` are
        ``[1, *, V]``, its ``cache`` (a transformers ``Cache``) goes to the next step.
    report : PatchReport
        What ``patch_moe_blocks`` returned on this rank: the group and the EP blocks.
    prompt : sequence of int or torch.Tensor or None
        ``[P]`` integer token ids of this rank's request; None or empty: no request (the rank
        runs every MoE block on zero tokens until the group is done).
    max_new_tokens : int
        ``≥ 0``: the most tokens this rank generates (0: no request).
    eos_token_id : int or sequence of int, optional
        Token ids that end the request (the ending token is kept); None: only
        ``max_new_tokens`` ends it.
    time_moe : bool, default True
        Time the EP blocks (synchronising the device around each on CUDA): ``moe_s``.
    on_step : callable, optional
        ``on_step(step: int) → None``, run on every rank after each lockstep step (1, 2, …);
        after a recovery, again for a step run again.

    Returns
    -------
    GreedyResult
        ``tokens`` (the generated ids), ``logits`` (``[N, V]`` float32 on CPU, the row each
        token was chosen from), the step counts and the wall times (seconds); on an elastic
        model the recoveries during the request (``lost_ranks``) and ``retried_steps``.

    Raises
    ------
    EPInputError
        ``max_new_tokens`` not an int ``≥ 0``, or a ``prompt`` that is not 1-D.
    RemoteRankError
        A rank was lost and the model is not elastic.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise EPInputError("max_new_tokens", "an int >= 0", max_new_tokens)
    prompt_ids = torch.as_tensor([] if prompt is None else prompt, dtype=torch.long)
    if prompt_ids.dim() != 1:
        raise EPInputError("prompt", "a 1-D sequence of token ids, or None", list(prompt_ids.shape))
    stop_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    decoder = _Decoder(model, report, prompt_ids, max_new_tokens, stop_ids)
    recovered_before = len(report.recoveries)
    clock = MoEClock(report) if time_moe else None
    with torch.no_grad(), clock or nullcontext():
        while True:
            try:
                if not decoder.step(on_step):
                    break
            except RemoteRankError:
                if report.recover() is None:  # not elastic, or nothing was lost
                    raise
                decoder.resume()
    report.check()  # verdicts recorded on the device (device_checks, capacity mode)
    rows = decoder.rows
    vocab = rows[0].numel() if rows else 0
    return GreedyResult(
        tokens=decoder.tokens,
        logits=torch.stack(rows) if rows else torch.empty(0, vocab),
        steps=decoder.steps,
        idle_steps=decoder.idle_steps,
        prefill_s=decoder.prefill_s,
        active_s=decoder.active_s,
        total_s=time.perf_counter() - decoder.started,
        moe_s=0.0 if clock is None else clock.seconds,
        recoveries=report.recoveries[recovered_before:],
        retried_steps=decoder.retried_steps,
    )


@dataclass(frozen=True)
class _Mark:
    """What a rank had after some lockstep steps: enough to go back to them."""

    idle_steps: int
    tokens: int
    cache_lengths: tuple[int, ...] | None  # each KV-cache layer's length; None: no cache yet


class _Decoder:
    """One rank's request through the lockstep steps, with a mark after each step."""

    def __init__(
        self,
        model: nn.Module,
        report: PatchReport,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        stop_ids: set[int],
    ) -> None:
        self.model, self.report = model, report
        self.prompt_ids, self.max_new_tokens, self.stop_ids = prompt_ids, max_new_tokens, stop_ids
        self.device = next(model.parameters()).device
        self.has_request = prompt_ids.numel() > 0 and max_new_tokens > 0
        self.tokens: list[int] = []
        self.rows: list[torch.Tensor] = []  # [V] each
        self.cache: Any = None
        self.steps = self.idle_steps = self.retried_steps = 0
        self.prefill_s = self.active_s = 0.0
        self.marks = [self._mark()]  # marks[s]: after s steps
        self.started = time.perf_counter()

    def step(self, on_step: Callable[[int], None] | None) -> bool:
        """One lockstep step; False where no rank generates any more (nothing was run)."""
        if on_step is not None and self.steps:
            on_step(self.steps)  # after step `steps`, before the group decides to go on
        tokens = self.tokens
        finished = bool(tokens) and (
            len(tokens) >= self.max_new_tokens or tokens[-1] in self.stop_ids
        )
        active = self.has_request and not finished
        if not self.report.anyone(active):
            return False
        if active:
            self._forward()
        else:
            self.report.forward_idle()  # timed by the clock's hooks like any MoE forward
            self.idle_steps += 1
        self.steps += 1
        self.marks.append(self._mark())
        return True

    def _forward(self) -> None:
        ids = self.prompt_ids[None] if not self.tokens else torch.tensor([self.tokens[-1:]])
        step_start = time.perf_counter()
        output = self.model(
            input_ids=ids.to(self.device), cache=self.cache, use_cache=True, logits_to_keep=1
        )
        self.cache = output.cache
        row = output.logits[0, -1].float()  # [V]
        self.rows.append(row.cpu())
        self.tokens.append(int(row.argmax()))
        now = time.perf_counter()
        self.active_s = now - self.started
        if len(self.tokens) == 1:
            self.prefill_s = now - step_start

    def resume(self) -> None:
        """After a failed step and the group's recovery: this rank's partial step undone, then
        back to the last step every survivor completed (at most one more here)."""
        self._restore(self.marks[self.steps])
        agreed = self.report.least(self.steps)
        self.retried_steps += 1 + self.steps - agreed
        self._restore(self.marks[agreed])
        del self.marks[agreed + 1 :]
        self.steps = agreed

    def _mark(self) -> _Mark:
        lengths = None if self.cache is None else _cache_lengths(self.cache)
        return _Mark(self.idle_steps, len(self.tokens), lengths)

    def _restore(self, mark: _Mark) -> None:
        del self.tokens[mark.tokens :], self.rows[mark.tokens :]
        self.idle_steps = mark.idle_steps
        if mark.cache_lengths is None:
            self.cache = None  # the prefill runs again on a new cache
        else:
            _crop(self.cache, mark.cache_lengths)


def _cache_lengths(cache: Any) -> tuple[int, ...]:
    return tuple(layer.get_seq_length() for layer in cache.layers)


def _crop(cache: Any, lengths: tuple[int, ...]) -> None:
    """Each layer of a transformers ``Cache`` back to its length in ``lengths`` (a layer added
    since: emptied). Per layer: a forward that failed part-way appended to the layers before the
    failure only."""
    for index, layer in enumerate(cache.layers):
        extra = layer.get_seq_length() - (lengths[index] if index < len(lengths) else 0)
        if extra > 0:
            layer.crop(-extra)  # a negative count removes that many tokens


class MoEClock:
    """Accumulates wall time spent inside the EP blocks (device-synchronised on CUDA)."""

    def __init__(self, report: PatchReport) -> None:
        self.report = report
        self.seconds = 0.0
        self._started = 0.0
        self._handles: list = []
        self._cuda = report.device.type == "cuda"

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.report.device)

    def _before(self, *_: object) -> None:
        self._sync()
        self._started = time.perf_counter()

    def _after(self, *_: object) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> MoEClock:
        for block in self.report.blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._before))
            self._handles.append(block.module.register_forward_hook(self._after))
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
