"""Which peers' notices concern a wait: a layer's close concerns only the forwards after the
last one the closing rank took its whole part in (a peer still receiving that forward's rows is
not stuck: the rows were sent); a dispatcher notice concerns every wait."""

import torch
import torch.distributed as dist

from ep_runtime.comm import DISPATCHER_NOTICE, GroupComm, InFlight, _Watch


def two_ranks() -> tuple[GroupComm, GroupComm]:
    store = dist.HashStore()
    return tuple(
        GroupComm(None, rank, 2, torch.device("cpu"), _Watch("ns", store, ())) for rank in (0, 1)
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
