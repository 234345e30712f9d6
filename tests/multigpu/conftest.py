"""Fixtures: one pool of rank processes per world size for the whole session."""

from __future__ import annotations

import contextlib

import pytest

from tests.multigpu.pool import PoolBroken, RankPool

_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        pool = RankPool(world_size)
        _POOLS[world_size] = pool
    return pool


@pytest.fixture
def pool_factory():
    return get_pool


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        with contextlib.suppress(PoolBroken):
            pool.close()
