"""The process-wide dispatchers: one instance per (backend, group, setup), shared by every layer
built for it (its buffers are the big allocation)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from ep_runtime.dispatch.base import Dispatcher
from ep_runtime.dispatch.setup import DispatchSetup, PeerSetup


@dataclass
class _SharedEntry:
    dispatcher: Dispatcher
    users: int = 0


@dataclass
class _SharedDispatchers:
    entries: dict[tuple, _SharedEntry] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_SHARED = _SharedDispatchers()


UNKEYED = ("comm", "device_checks")  # the comm by group and device; device_checks by its effect


def _key(cls: type[Dispatcher], setup: DispatchSetup) -> tuple:
    """The backend, the group, every other field of the setup (so a field added to
    ``DispatchSetup`` keys the cache by construction) and how forwards are checked (so
    ``device_checks`` splits the cache only where it changes something)."""
    group_key = id(setup.comm.group) if setup.comm.group is not None else None
    settings = tuple(
        (f.name, getattr(setup, f.name)) for f in dataclasses.fields(setup) if f.name not in UNKEYED
    )
    return (cls.name, group_key, setup.comm.device, settings, setup.checks)


def acquire_dispatcher(
    cls: type[Dispatcher], setup: DispatchSetup, peer_setup: PeerSetup
) -> Dispatcher:
    """The process-wide instance of ``cls`` for ``setup`` (buffers are shared by all layers)."""
    key = _key(cls, setup)
    with _SHARED.lock:
        entry = _SHARED.entries.get(key)
        if entry is None:
            entry = _SharedEntry(cls(setup, peer_setup))
            _SHARED.entries[key] = entry
        entry.users += 1
        return entry.dispatcher


def release_dispatcher(dispatcher: Dispatcher) -> None:
    """Drop one user; the last one closes the dispatcher and frees its buffers."""
    with _SHARED.lock:
        for key, entry in list(_SHARED.entries.items()):
            if entry.dispatcher is dispatcher:
                entry.users -= 1
                if entry.users == 0:
                    del _SHARED.entries[key]
                    dispatcher.close()
                return
