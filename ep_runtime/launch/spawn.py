"""Spawn launcher: N processes on this node via torch.multiprocessing, no Ray.

The parent hosts the TCPStore on port 0 (the kernel picks the port; no race) and supervises the
children: on the first failure it collects failures for a grace window, terminates the rest and
raises the root cause. An elastic run's ranks named in ``--kill-rank`` SIGKILL themselves: that
death is no failure; the parent goes on collecting the survivors' summaries. Rank r uses GPU r
in CUDA mode. The store, gloo and NCCL listen on loopback only (``rendezvous``, ``network``):
nothing of the run is reachable from elsewhere.

Only the parent acts on Ctrl-C: the children are started with SIGINT blocked and then ignore it,
so a Ctrl-C in the terminal (SIGINT to the whole process group) makes the parent stop every rank
and exit 130. A child also dies with the parent, even when the parent is SIGKILLed: on Linux it
asks the kernel for SIGKILL on the parent's death (``prctl(PR_SET_PDEATHSIG)``), and it exits at
once if the parent was already gone by then.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp

from ep_runtime.launch.progress import ProgressFactory
from ep_runtime.launch.rank import RankWorker, plan, run_plan
from ep_runtime.launch.rendezvous import LOOPBACK, host_store, join_store
from ep_runtime.launch.spec import RunSpec, resolve_device
from ep_runtime.launch.supervision import (
    GRACE_S,
    Failure,
    FailureKind,
    classify_exception_text,
    raise_if_stop_requested,
    root_failure,
    usage_error_line,
    window_closed,
)

POLL_S = 0.1
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux), and exit now if the
    parent already has (it may have died before the request was made)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if os.getppid() != parent_pid:
        os._exit(1)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread while children are started: they inherit the blocked mask
    (so a Ctrl-C during their start-up cannot reach them); the parent gets it afterwards."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _rank_main(rank: int, spec: RunSpec, port: int, events: mp.Queue, parent_pid: int) -> None:
    """Child process: run the whole plan; report steps (the workload's reporting rank), the
    summary, or the error."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C does
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one is discarded
    try:
        store = join_store(LOOPBACK, port, None, spec.timeout_s)
        worker = RankWorker(spec, rank, rank if spec.device == "cuda" else None, LOOPBACK)
        worker.init_process_group(store=store)
        reporter = spec.workload.reporting_rank
        on_step = (lambda step: events.put(("step", rank, step))) if rank == reporter else None
        summary = run_plan(worker, on_step)
        worker.shutdown()
        events.put(("result", rank, summary))
    except BaseException as error:
        text = f"rank {rank} raised:\n{traceback.format_exc()}"
        events.put(("error", rank, (text, usage_error_line(error))))
        raise SystemExit(1) from None


def run_with_spawn(spec: RunSpec, progress_factory: ProgressFactory) -> tuple[RunSpec, list[dict]]:
    """Run ``spec`` in ``world_size`` child processes; returns every rank's summary, by rank."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = resolve_device(spec.device, spec.world_size, gpus, "this machine")
    spec = dataclasses.replace(spec, device=device)
    steps = plan(spec)
    store = host_store(LOOPBACK, None, spec.timeout_s)
    context = mp.get_context("spawn")
    events = context.Queue()
    processes = [
        context.Process(
            target=_rank_main, args=(rank, spec, store.port, events, os.getpid()), daemon=True
        )
        for rank in range(spec.world_size)
    ]
    with progress_factory(steps) as progress:
        progress.status("starting rank processes")
        try:
            with sigint_blocked():
                for process in processes:
                    process.start()
            return spec, _supervise(processes, events, progress, spec.workload.killed_ranks)
        finally:
            _terminate(processes)


def _supervise(processes, events, progress, killed: frozenset[int] = frozenset()) -> list[dict]:
    """Collect summaries until every rank reported, or was SIGKILLed being one of ``killed``
    (an elastic run's ``--kill-rank``: the others go on without it); on the first failure,
    raise its root cause. Returns the summaries by rank, of the ranks that reported."""
    summaries: dict[int, dict] = {}
    errors: dict[int, tuple[str, str | None]] = {}  # rank -> (traceback, usage error line)
    failed_order: list[int] = []  # ranks in the order their failure was noticed
    lost: set[int] = set()  # ranks of ``killed`` that died as told
    first_failure_at = 0.0
    while len(summaries) + len(lost) < len(processes):
        raise_if_stop_requested()
        _drain(events, progress, summaries, errors)
        for rank, process in enumerate(processes):
            if rank in killed and rank not in errors and process.exitcode == -signal.SIGKILL:
                lost.add(rank)
                continue
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
        return [summaries[rank] for rank in sorted(summaries)]
    raise_if_stop_requested()  # ranks that failed because of the Ctrl-C are no failure
    _drain(events, progress, summaries, errors)  # an error sent just before its process exited
    failures = [
        _failure(rank, processes[rank], errors.get(rank), order)
        for order, rank in enumerate(failed_order)
    ]
    running = [r for r, p in enumerate(processes) if p.is_alive() and r not in errors]
    raise root_failure(failures, "the run", still_running=running)


def _drain(
    events, progress, summaries: dict[int, dict], errors: dict[int, tuple[str, str | None]]
) -> None:
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


def _failure(rank: int, process, error: tuple[str, str | None] | None, order: int) -> Failure:
    if error is not None:
        text, usage = error
        return Failure(rank, classify_exception_text(text), text, order, usage)
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
