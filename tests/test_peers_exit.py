"""The exit wait for gloo (``comm_process.GLOO_RELEASE_S``): registered once per process, and
only where a dispatcher runs on a gloo group. Its effect (no SIGABRT at exit after a peer died)
is asserted by the dying-rank tests in tests/multigpu/test_failures.py, which require exit codes
0 and 1."""

from __future__ import annotations

import sys

import pytest
import torch

from ep_runtime import comm_process
from ep_runtime.comm import Comm, GroupComm, PeerIdentity, SingleRankComm


@pytest.fixture
def registrations(monkeypatch) -> list[tuple]:
    """What ``atexit.register`` was asked for, with a fresh once-per-process cache."""
    seen: list[tuple] = []
    monkeypatch.setattr(comm_process.atexit, "register", lambda *args: seen.append(args))
    monkeypatch.setattr(comm_process, "group_store", lambda group: object())  # a store is there
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    comm_process._wait_for_gloo_at_exit.cache_clear()
    yield seen
    comm_process._wait_for_gloo_at_exit.cache_clear()


def _peers_on(monkeypatch, backend: str, world_size: int = 2) -> Comm:
    """A dispatcher's watched comm on a group of ``world_size`` that claims ``backend``."""
    monkeypatch.setattr(Comm, "backend", property(lambda self: backend))
    device = torch.device("cpu")
    group = object()
    if world_size == 1:
        comm: Comm = SingleRankComm(device, group)  # type: ignore[arg-type]
    else:
        comm = GroupComm(group, 0, world_size, device)  # type: ignore[arg-type]
    identities = [PeerIdentity("elsewhere", 1)] * world_size
    return comm.watched("test", identities)


def test_gloo_dispatchers_register_one_exit_wait(monkeypatch, registrations) -> None:
    kept = [_peers_on(monkeypatch, "gloo") for _ in range(3)]
    assert registrations == [(comm_process.time.sleep, comm_process.GLOO_RELEASE_S)], registrations
    assert len(kept) == 3


@pytest.mark.parametrize(("backend", "world_size"), [("nccl", 2), ("gloo", 1)])
def test_no_exit_wait_without_a_gloo_peer(monkeypatch, registrations, backend, world_size):
    _peers_on(monkeypatch, backend, world_size)
    assert registrations == []
