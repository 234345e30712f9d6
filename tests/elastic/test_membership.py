"""Who survived (ep_runtime/elastic/membership.py): survivors agree on one member list through a
store, a rank known gone does not hold it up, a silent one is out after the join window, and a
rank that joins after the list closed is told it is out."""

from __future__ import annotations

import threading
import time

import pytest

from ep_runtime.elastic import CountedOutError
from ep_runtime.elastic.membership import agree_members
from ep_runtime.launch.rendezvous import LOOPBACK, host_store, join_store


@pytest.fixture
def store():
    server = host_store(LOOPBACK, None, 30)
    yield lambda: join_store(LOOPBACK, server.port, None, 30)


def join_all(store, ranks, previous, gone=(), window=3.0, delays=None):
    results, errors = {}, {}

    def member(rank):
        time.sleep((delays or {}).get(rank, 0.0))
        try:
            results[rank] = agree_members(
                store(), 1, rank, previous, lambda r: r in gone, join_window_s=window
            )
        except Exception as error:
            errors[rank] = error

    threads = [threading.Thread(target=member, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results, errors


def test_survivors_agree_at_once_when_the_lost_rank_is_known_gone(store):
    start = time.monotonic()
    results, errors = join_all(store, [0, 1, 3], (0, 1, 2, 3), gone={2}, window=10.0)
    assert not errors
    assert {r.members for r in results.values()} == {(0, 1, 3)}
    assert results[3].new_rank(3) == 2 and results[0].left_out == (2,)
    assert time.monotonic() - start < 5.0  # not the 10 s window


def test_a_silent_rank_is_out_after_the_window(store):
    start = time.monotonic()
    results, errors = join_all(store, [0, 1], (0, 1, 2), window=1.0)
    assert not errors and {r.members for r in results.values()} == {(0, 1)}
    assert time.monotonic() - start >= 1.0


def test_a_late_rank_is_counted_out_on_every_survivor(store):
    results, errors = join_all(store, [0, 1, 2], (0, 1, 2), window=0.5, delays={2: 2.0})
    assert {r.members for r in results.values()} == {(0, 1)}
    assert isinstance(errors[2], CountedOutError) and "original rank 2" in str(errors[2])
