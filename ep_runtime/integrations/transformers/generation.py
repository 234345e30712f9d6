"""Lockstep greedy generation on a patched model: every rank stays in every MoE collective until
all ranks are done (a rank with no request, or a finished one, runs each MoE block on zero tokens),
and the wall time spent inside the EP blocks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ep_runtime.integrations.transformers.patching import PatchReport
from ep_runtime.types import EPInputError


@dataclass
class GreedyResult:
    """One rank's request: its tokens and logits, and where the time went."""

    tokens: list[int]  # generated ids; the EOS that ended the request is included
    logits: torch.Tensor  # [N, V] float32 on CPU: the logits each token was chosen from
    steps: int  # lockstep steps of the whole group (the same on every rank)
    idle_steps: int  # steps this rank ran every MoE block on zero tokens
    prefill_s: float  # this rank's first forward (0 without a request)
    active_s: float  # first step to this rank's last token (0 without a request)
    total_s: float  # first step to the group's last
    moe_s: float  # inside the EP blocks (router, dispatch, experts, combine, shared experts)


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

    Parameters
    ----------
    model : torch.nn.Module
        The model ``patch_moe_blocks`` patched; called with ``input_ids [1, P]`` (then
        ``[1, 1]``), ``cache`` and ``use_cache=True``; its output's ``logits`` are
        ``[1, *, V]``, its ``cache`` goes to the next step.
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
        ``on_step(step: int) → None``, run on every rank after each lockstep step (1, 2, …).

    Returns
    -------
    GreedyResult
        ``tokens`` (the generated ids), ``logits`` (``[N, V]`` float32 on CPU, the row each
        token was chosen from), the step counts and the wall times (seconds).

    Raises
    ------
    EPInputError
        ``max_new_tokens`` not an int ``≥ 0``, or a ``prompt`` that is not 1-D.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise EPInputError("max_new_tokens", "an int >= 0", max_new_tokens)
    prompt_ids = torch.as_tensor([] if prompt is None else prompt, dtype=torch.long)
    if prompt_ids.dim() != 1:
        raise EPInputError("prompt", "a 1-D sequence of token ids, or None", list(prompt_ids.shape))
    stop_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    device = next(model.parameters()).device
    has_request = prompt_ids.numel() > 0 and max_new_tokens > 0
    next_input = prompt_ids[None].to(device)  # [1, P], then [1, 1]
    tokens: list[int] = []
    rows: list[torch.Tensor] = []  # [V] each
    cache = None
    steps = idle_steps = 0
    prefill_s = active_s = 0.0
    clock = MoEClock(report) if time_moe else None
    started = time.perf_counter()
    with torch.no_grad(), clock or nullcontext():
        while True:
            if on_step is not None and steps:
                on_step(steps)  # after step `steps`, before the group decides to go on
            finished = bool(tokens) and (len(tokens) >= max_new_tokens or tokens[-1] in stop_ids)
            active = has_request and not finished
            if not report.anyone(active):
                break
            steps += 1
            if not active:
                report.forward_idle()  # timed by the clock's hooks like any MoE forward
                idle_steps += 1
                continue
            step_start = time.perf_counter()
            output = model(input_ids=next_input, cache=cache, use_cache=True, logits_to_keep=1)
            cache = output.cache
            row = output.logits[0, -1].float()  # [V]
            token = int(row.argmax())
            rows.append(row.cpu())
            tokens.append(token)
            next_input = torch.tensor([[token]], dtype=torch.long, device=device)
            now = time.perf_counter()
            active_s = now - started
            if len(tokens) == 1:
                prefill_s = now - step_start
    report.check()  # verdicts recorded on the device (device_checks, capacity mode)
    vocab = rows[0].numel() if rows else 0
    return GreedyResult(
        tokens=tokens,
        logits=torch.stack(rows) if rows else torch.empty(0, vocab),
        steps=steps,
        idle_steps=idle_steps,
        prefill_s=prefill_s,
        active_s=active_s,
        total_s=time.perf_counter() - started,
        moe_s=0.0 if clock is None else clock.seconds,
    )


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
