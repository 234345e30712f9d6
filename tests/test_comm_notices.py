"""Which peers' notices concern a wait: a layer's close concerns only the forwards after the
last one the closing rank took its whole part in (a peer still receiving that forward's rows is
not stuck: the rows were sent); a dispatcher notice concerns every wait."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ep_runtime.comm import DIAGNOSE_S, DISPATCHER_NOTICE, GroupComm, InFlight, SingleRankComm
from ep_runtime.comm_notices import NoticeBoard
from ep_runtime.types import GroupUnusableError


def two_ranks() -> tuple[GroupComm, GroupComm]:
    store = dist.HashStore()
    return tuple(
        GroupComm(None, rank, 2, torch.device("cpu"), NoticeBoard("ns", store, ()))
        for rank in (0, 1)
    )


def test_a_close_after_forward_n_concerns_forward_n_plus_one_only() -> None:
    waiting, closing = two_ranks()
    closing.post("layer0", "closed layer 0 (EPMoE.close()) after its forward 3", after_forward=3)
    for forward in (1, 3):
        waiting.in_flight = InFlight(layer=0, forward=forward)
        assert waiting._trouble() is None, forward
    waiting.in_flight = InFlight(layer=0, forward=4)
    assert waiting._trouble() == (1, "closed layer 0 (EPMoE.close()) after its forward 3")


def test_a_close_concerns_only_its_own_layer() -> None:
    waiting, closing = two_ranks()
    closing.post("layer1", "closed layer 1", after_forward=0)
    waiting.in_flight = InFlight(layer=0, forward=5)
    assert waiting._trouble() is None
    waiting.in_flight = InFlight(layer=1, forward=1)
    assert waiting._trouble() == (1, "closed layer 1")


def test_a_failure_notice_concerns_every_wait() -> None:
    waiting, failing = two_ranks()
    failing.post(DISPATCHER_NOTICE, "failed inside combine: RuntimeError: boom")
    for in_flight in (None, InFlight(layer=2, forward=1)):
        waiting.in_flight = in_flight
        assert waiting._trouble() == (1, "failed inside combine: RuntimeError: boom")


class ScriptedWork:
    """A gloo ``Work`` whose first timed wait times out, as a slice does, though it completes at
    that moment; afterwards it has ``outcome`` (None: success, else that exception)."""

    def __init__(self, outcome: Exception | None) -> None:
        self.outcome = outcome
        self.timed_waits = 0

    def wait(self, timeout=None) -> bool:
        if timeout is not None and self.timed_waits == 0:
            self.timed_waits += 1
            raise RuntimeError("Operation timed out!")
        if self.outcome is not None:
            raise self.outcome
        return True

    def is_completed(self) -> bool:
        return self.timed_waits > 0


def watched_gloo_rank(monkeypatch) -> GroupComm:
    comm = two_ranks()[0]
    monkeypatch.setattr(GroupComm, "backend", property(lambda self: "gloo"))
    return comm


def test_a_collective_finishing_as_its_slice_times_out_is_a_success(monkeypatch) -> None:
    comm = watched_gloo_rank(monkeypatch)
    comm._wait(ScriptedWork(outcome=None), "all_to_all")  # returns: no error, group usable
    comm.check_usable()


def test_a_collective_that_failed_is_still_diagnosed(monkeypatch) -> None:
    monkeypatch.setattr("ep_runtime.comm.DIAGNOSE_S", min(DIAGNOSE_S, 0.1))
    comm = watched_gloo_rank(monkeypatch)
    with pytest.raises(GroupUnusableError, match="Connection closed by peer"):
        comm._wait(ScriptedWork(outcome=RuntimeError("Connection closed by peer")), "all_to_all")


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def ranks_with_a_dead_peer(world: int, dead: int) -> list[GroupComm]:
    """Watched comms of the live ranks of ``world`` over one store; rank ``dead``'s process is
    gone (a pid that has exited)."""
    store = dist.HashStore()
    peers = ((dead, _dead_pid()),)
    return [
        GroupComm(None, rank, world, torch.device("cpu"), NoticeBoard("ns", store, peers))
        for rank in range(world)
        if rank != dead
    ]


def test_a_vote_counts_a_rank_that_died_after_voting_with_its_vote() -> None:
    """Its key was written before it died: every survivor reads the same votes, none fails."""
    comms = ranks_with_a_dead_peer(3, dead=2)
    comms[0]._watch.cast_vote("b1", 2, None)  # what rank 2 wrote before it died
    comms[1]._watch.cast_vote("b1", 1, "RuntimeError: staging failed")
    assert comms[0].vote("b1", None) == [None, "RuntimeError: staging failed", None]
    comms[0].check_usable()


def test_a_rank_gone_before_its_vote_fails_the_vote_on_every_survivor() -> None:
    comms = ranks_with_a_dead_peer(3, dead=2)
    comms[1]._watch.cast_vote("b1", 1, None)
    votes = comms[0].vote("b1", None)
    assert votes[:2] == [None, None], votes
    assert votes[2].startswith("is gone: its process") and "before its vote on b1" in votes[2]
    with pytest.raises(GroupUnusableError, match="rank 2 is gone"):
        comms[0].check_usable()  # the group lost a member: later collectives are refused


def test_a_vote_alone_is_its_own() -> None:
    assert SingleRankComm(torch.device("cpu")).vote("b1", "why not") == ["why not"]
