"""Spawn launcher: N processes on this node via torch.multiprocessing, no Ray.

The parent hosts the TCPStore on port 0 (the kernel picks the port; no race) and supervises the
children: on the first failure it collects failures for a grace window, terminates the rest and
raises the root cause. Rank r uses GPU r in CUDA mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_runtime.launch.progress import ProgressFactory
from ep_runtime.launch.rank import RankWorker, plan, run_plan
from ep_runtime.launch.spec import LaunchError, RunSpec
from ep_runtime.launch.supervision import (
    GRACE_S,
    Failure,
    FailureKind,
    classify_exception_text,
    raise_if_stop_requested,
    root_failure,
    window_closed,
)

POLL_S = 0.1


def resolve_device(requested: str, world_size: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < world_size:
        raise LaunchError(f"--device cuda: {gpus} GPUs visible, --dp {world_size} needs one each")
    if requested == "auto":
        return "cuda" if gpus >= world_size else "cpu"
    return requested


def _rank_main(rank: int, spec: RunSpec, port: int, events: mp.Queue) -> None:
    """Child process: run the whole plan; report steps (rank 0), the summary, or the error."""
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=spec.timeout_s)
        )
        worker = RankWorker(spec, rank, rank if spec.device == "cuda" else None)
        worker.init_process_group(store=store)
        on_step = (lambda step: events.put(("step", rank, step))) if rank == 0 else None
        summary = run_plan(worker, on_step)
        worker.shutdown()
        events.put(("result", rank, summary))
    except BaseException:
        events.put(("error", rank, f"rank {rank} raised:\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def run_with_spawn(spec: RunSpec, progress_factory: ProgressFactory) -> tuple[RunSpec, list[dict]]:
    """Run ``spec`` in ``world_size`` child processes; returns every rank's summary, by rank."""
    spec = dataclasses.replace(spec, device=resolve_device(spec.device, spec.world_size))
    steps = plan(spec)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    events = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(rank, spec, store.port, events), daemon=True)
        for rank in range(spec.world_size)
    ]
    with progress_factory(steps) as progress:
        progress.status("starting rank processes")
        for process in processes:
            process.start()
        try:
            return spec, _supervise(processes, events, progress)
        finally:
            _terminate(processes)


def _supervise(processes, events, progress) -> list[dict]:
    """Collect summaries until every rank reported; on the first failure, raise its root cause."""
    summaries: dict[int, dict] = {}
    errors: dict[int, str] = {}
    failed_order: list[int] = []  # ranks in the order their failure was noticed
    first_failure_at = 0.0
    while len(summaries) < len(processes):
        raise_if_stop_requested()
        _drain(events, progress, summaries, errors)
        for rank, process in enumerate(processes):
            failed = rank in errors or process.exitcode not in (None, 0)
            if failed and rank not in failed_order:
                failed_order.append(rank)
                first_failure_at = first_failure_at or time.monotonic()
        # certain so far: an error message, or death by a signal (an exit code > 0 may be a
        # rank whose message is still in the queue)
        known = [
            _failure(rank, processes[rank], errors.get(rank), order)
            for order, rank in enumerate(failed_order)
            if rank in errors or (processes[rank].exitcode or 0) < 0
        ]
        if failed_order and (
            window_closed(known, first_failure_at, time.monotonic())
            or time.monotonic() - first_failure_at >= GRACE_S
        ):
            break
    if not failed_order:
        return [summaries[rank] for rank in range(len(processes))]
    _drain(events, progress, summaries, errors)  # an error sent just before its process exited
    failures = [
        _failure(rank, processes[rank], errors.get(rank), order)
        for order, rank in enumerate(failed_order)
    ]
    running = [r for r, p in enumerate(processes) if p.is_alive() and r not in errors]
    raise root_failure(failures, "the run", still_running=running)


def _drain(events, progress, summaries: dict[int, dict], errors: dict[int, str]) -> None:
    """Handle every queued event, waiting at most ``POLL_S`` for the first."""
    with contextlib.suppress(queue.Empty):
        while True:
            kind, rank, payload = events.get(timeout=POLL_S)
            if kind == "step":
                progress.done(payload)
            elif kind == "result":
                summaries[rank] = payload
            else:
                errors[rank] = payload


def _failure(rank: int, process, error_text: str | None, order: int) -> Failure:
    if error_text is not None:
        return Failure(rank, classify_exception_text(error_text), error_text, order)
    code = process.exitcode
    how = (
        f"killed by {signal.Signals(-code).name}"
        if code is not None and code < 0
        else f"exit code {code}"
    )
    return Failure(rank, FailureKind.DIED, f"rank {rank} (pid {process.pid}) died: {how}", order)


def _terminate(processes) -> None:
    """SIGTERM the survivors, then SIGKILL those still there after 3 s."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 3
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(1)
