"""The process-level side of watching peers: the store torch built a group on, whether a peer's
process on this host still runs, and what this process does for its watched groups as it ends
(an uncaught exception is posted to the peers; gloo gets a moment to let go)."""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import torch.distributed as dist


class Notifying(Protocol):
    """What the exit hook needs of a watched comm."""

    def leave_in_failure(self, reason: str) -> None: ...


# At exit, a gloo worker thread can still be letting go of the last collective's tensors; if the
# interpreter is already finalizing, taking the GIL for that ends the thread by a forced unwind
# through torch's C++ frames, and the process aborts (SIGABRT, "terminate called without an active
# exception", in ProcessGroupGloo::runLoop → TensorImpl::decref_pyobject). Exit waits this long
# first, while the interpreter can still serve it.
GLOO_RELEASE_S = 0.2


def group_store(group: dist.ProcessGroup | None) -> dist.Store | None:
    """The store the group was built on (torch keeps it privately), or None."""
    if group is None:
        return None
    try:
        if group is dist.group.WORLD:
            return dist.distributed_c10d._get_default_store()
        return dist.distributed_c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, RuntimeError, ValueError):
        return None


def process_is_gone(pid: int) -> bool:
    """True if ``pid`` (on this host) no longer runs: no such process, or a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


_NOTIFYING: weakref.WeakSet[Notifying] = weakref.WeakSet()


class _ExitNotices:
    """``sys.excepthook`` while dispatchers are open: an uncaught exception ends this process,
    so tell the peers of every watched group why, then run the hook it replaced."""

    def __init__(self, previous: Callable) -> None:
        self.previous = previous

    def __call__(
        self, kind: type[BaseException], value: BaseException, trace: TracebackType | None
    ) -> None:
        for comm in list(_NOTIFYING):
            comm.leave_in_failure(f"exited on an uncaught {kind.__name__}: {value}")
        self.previous(kind, value, trace)


def notify_peers_at_exit(comm: Notifying, gloo: bool) -> None:
    """While ``comm`` lives (or until ``stop_notifying``), an uncaught exception ending this
    process is posted to its peers; on gloo, exit also waits ``GLOO_RELEASE_S``."""
    _NOTIFYING.add(comm)
    if not isinstance(sys.excepthook, _ExitNotices):
        sys.excepthook = _ExitNotices(sys.excepthook)
    if gloo:
        _wait_for_gloo_at_exit()


def stop_notifying(comm: Notifying) -> None:
    _NOTIFYING.discard(comm)


@functools.cache
def _wait_for_gloo_at_exit() -> None:
    """Once per process, the first time a dispatcher runs on a gloo group (GLOO_RELEASE_S)."""
    atexit.register(time.sleep, GLOO_RELEASE_S)
