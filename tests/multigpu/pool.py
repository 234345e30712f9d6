"""A pool of real rank processes per world size, reused across test cases.

Each rank is a process of its own with a torch.distributed group (NCCL when there is one GPU per
rank, else gloo on CPU) and an explicit timeout. ``RankPool.run(fn, *args)`` runs ``fn`` on every
rank and returns the per-rank results (or ``RankFailure``s); a case that hangs past its timeout
tears the pool down so the next case gets a fresh one. Nothing waits forever.

Rank processes come from a fork server that has imported torch and this module once (it never
touches a GPU), so a fresh pool costs a fork per rank instead of a new interpreter importing
torch (seconds per rank on a 2-core machine); each rank starts from the environment of the
process that made its pool, as a spawned one would.
"""

from __future__ import annotations

import importlib
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_runtime.launch.network import apply_interface_defaults
from ep_runtime.launch.rendezvous import LOOPBACK, host_store, join_store

# collective timeout: a hung case fails after it; it must outlast the slowest rank's work
# between two collectives (the Triton interpreter's cases, with two pytest workers sharing two
# cores, took over 20 s); raise it where first-use JIT (DeepEP) stalls a rank for longer
GROUP_TIMEOUT_S = float(os.environ.get("EP_TEST_GROUP_TIMEOUT_S", "60"))
BACKEND_MODULES_ENV = "EP_TEST_BACKEND_MODULES"  # modules registering test-defined backends


def import_test_backends() -> None:
    """Register the backends of the modules ``EP_TEST_BACKEND_MODULES`` names (each module's
    ``register()``)."""
    for name in filter(None, os.environ.get(BACKEND_MODULES_ENV, "").split(",")):
        importlib.import_module(name.strip()).register()


@dataclass(frozen=True)
class RankFailure:
    """What a rank raised: its type name, message and traceback."""

    rank: int
    type_name: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


def _breaks_the_group(failure: RankFailure) -> bool:
    return (
        failure.type_name.startswith("Dist")
        or failure.type_name == "GroupUnusableError"
        or "timed out" in failure.message.lower()
        or "out of step" in failure.message
    )


class PoolBroken(RuntimeError):
    """The pool timed out or a rank process died; it has been shut down."""


def pick_backend(world_size: int) -> str:
    forced = os.environ.get("EP_TEST_BACKEND")
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    timeout_s: float,
    env: dict[str, str],
    inbox,
    outbox,
) -> None:
    os.environ.clear()  # the fork server's environment is the one it started with
    os.environ.update(env)
    apply_interface_defaults(LOOPBACK)  # gloo and NCCL on loopback, as the store
    import_test_backends()
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = join_store(LOOPBACK, port, world_size + 1, timeout_s)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    outbox.put(("ready", rank, None))
    while True:
        task = inbox.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            outbox.put((task_id, rank, ("ok", fn(*args, **kwargs))))
        except BaseException as error:  # reported to the parent, never swallowed
            failure = RankFailure(rank, type(error).__name__, str(error), traceback.format_exc())
            outbox.put((task_id, rank, ("error", failure)))
    dist.destroy_process_group()


class RankPool:
    def __init__(
        self,
        world_size: int,
        start_timeout_s: float = 120.0,
        group_timeout_s: float = GROUP_TIMEOUT_S,
        env: dict[str, str] | None = None,  # set in every rank process (over this one's)
    ) -> None:
        self.world_size = world_size
        self.backend = pick_backend(world_size)
        context = mp.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # torch and this module, imported once
        self._store = host_store(LOOPBACK, world_size + 1, group_timeout_s)
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(world_size)]
        self._processes = [
            context.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    self.backend,
                    self._store.port,
                    group_timeout_s,
                    {**os.environ, **(env or {})},
                    self._inboxes[rank],
                    self._outbox,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self._task_id = 0
        self.broken = False
        self._collect("ready", start_timeout_s)

    def _collect(self, task_id: object, timeout_s: float, dying: int | None = None) -> list[Any]:
        """Every rank's payload for ``task_id``; ``dying``: a rank meant to die in this task,
        whose payload is not waited for (``None``) and whose death breaks nothing."""
        results: dict[int, Any] = {}
        awaited = set(range(self.world_size)) - {dying}
        deadline = time.monotonic() + timeout_s
        while not awaited <= set(results):
            remaining = deadline - time.monotonic()
            try:
                got_id, rank, payload = self._outbox.get(timeout=max(0.01, min(1.0, remaining)))
            except queue.Empty:
                dead = [r for r in awaited if not self._processes[r].is_alive()]
                if time.monotonic() >= deadline or dead:
                    self.close()
                    reason = "a rank process died" if dead else f"no result in {timeout_s:.0f} s"
                    raise PoolBroken(f"{reason}; ranks done: {sorted(results)}") from None
                continue
            if got_id == task_id:
                results[rank] = payload
        return [results.get(rank) for rank in range(self.world_size)]

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; per-rank result or ``RankFailure``."""
        if self.broken:
            raise PoolBroken("pool was shut down")
        self._task_id += 1
        for inbox in self._inboxes:
            inbox.put((self._task_id, fn, args, kwargs))
        payloads = self._collect(self._task_id, timeout_s)
        results = [value for _, value in payloads]
        if any(isinstance(r, RankFailure) and _breaks_the_group(r) for r in results):
            self.close()  # a timed-out collective can leave the group out of step
        return results

    def run_with_a_death(
        self,
        fn: Callable[..., Any],
        *args: Any,
        dying: int,
        timeout_s: float = 120.0,
        **kwargs: Any,
    ) -> tuple[list[Any], list[int | None]]:
        """``fn(*args, **kwargs)`` on every rank, in which rank ``dying`` is meant to die (a
        group cannot go on without it): each survivor's result or ``RankFailure`` (``None`` at
        ``dying``); then the pool is closed (each survivor tears its group down and exits);
        and every rank process's exit code (minus the signal that ended it)."""
        if self.broken:
            raise PoolBroken("pool was shut down")
        self._task_id += 1
        for inbox in self._inboxes:
            inbox.put((self._task_id, fn, args, kwargs))
        try:
            payloads = self._collect(self._task_id, timeout_s, dying)
        finally:
            self.close()
        results = [None if payload is None else payload[1] for payload in payloads]
        return results, [process.exitcode for process in self._processes]

    def run_ok(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Like ``run`` but raises if any rank failed, with every rank's traceback."""
        results = self.run(fn, *args, **kwargs)
        failures = [r for r in results if isinstance(r, RankFailure)]
        if failures:
            raise AssertionError("\n".join(f"{f}\n{f.traceback}" for f in failures))
        return results

    def close(self) -> None:
        if self.broken:
            return
        self.broken = True
        for inbox in self._inboxes:
            inbox.put(None)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
