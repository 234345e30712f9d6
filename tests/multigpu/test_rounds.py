"""Exact mode sizes its buffers to the forward: one round by default, rounds only where a bound
(the user's ``max_tokens_per_rank``, the dispatcher's, free device memory) asks for them, the
number of rounds agreed by every rank, the output unchanged (issue 25)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.multigpu.rank_inputs import CaseSpec
from tests.multigpu.round_cases import run_rounds_case

PREFILL = 4096


def spec_for(world: int, layout: str, cap: int | None, tokens: tuple[int, ...] | None = None):
    return CaseSpec(
        experts="reference",  # fp32 on every device (grouped_mm on CUDA is bf16 only)
        layout=layout,
        dtype=torch.float32,
        num_experts=6,  # a multiple of every world size here
        hidden=64,
        intermediate=32,
        tokens=tokens or (PREFILL,) * world,
        cap=cap,  # type: ignore[arg-type]  # None: no bound of the user's
    )


def run(pool, spec: CaseSpec, free_tokens=None):
    results = pool.run_ok(run_rounds_case, spec, free_tokens)
    bad = [f"rank {r.rank}: {r.comparison.describe()}" for r in results if not r.comparison.passed]
    assert not bad, "\n".join(bad)
    return results


@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_prefill_runs_as_one_round_by_default(pool_factory, world: int, layout: str) -> None:
    results = run(pool_factory(world), spec_for(world, layout, cap=None))
    assert [r.rounds for r in results] == [1] * world
    assert {r.settings["max_tokens_per_rank"] for r in results} == {"none"}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_users_cap_bounds_each_round(pool_factory, world: int) -> None:
    """A cap of 1000: 5 rounds for 4096 tokens, on every rank, even one with fewer tokens."""
    tokens = (PREFILL, 1500, 0)[:world]
    results = run(pool_factory(world), spec_for(world, "expanded", cap=1000, tokens=tokens))
    assert [r.rounds for r in results] == [math.ceil(PREFILL / 1000)] * world
    assert {r.settings["max_tokens_per_rank"] for r in results} == {"1000"}


def test_memory_bounds_differ_per_rank_and_the_ranks_agree_stand_in_free_memory(
    pool_factory,
) -> None:
    """Free memory (a stand-in for CUDA's reader) for 700 tokens on rank 0, 3000 on rank 1, no
    bound on rank 2: every rank runs ceil(4096 / 700) = 6 rounds; the settings (and so the
    fingerprint) stay the same on every rank."""
    free = (700, 3000, None)
    results = run(pool_factory(3), spec_for(3, "expanded", cap=None), free_tokens=free)
    assert [r.tokens_per_round for r in results] == [700, 3000, PREFILL]
    assert [r.rounds for r in results] == [math.ceil(PREFILL / 700)] * 3
    assert len({tuple(r.settings.items()) for r in results}) == 1


def test_the_smallest_bound_wins(pool_factory) -> None:
    """The user's cap of 1000 under a memory bound of 3000: 1000 tokens per round."""
    results = run(pool_factory(2), spec_for(2, "standard", cap=1000), free_tokens=(3000, 500))
    assert [r.tokens_per_round for r in results] == [1000, 500]
    assert [r.rounds for r in results] == [math.ceil(PREFILL / 500)] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_free_device_bytes_is_the_driver_free_plus_the_allocators_unused_cache() -> None:
    from ep_runtime.rounds import free_device_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del held  # 64 MiB back in the allocator's cache, reserved but not allocated
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert unused >= 64 << 20
    assert free_device_bytes(device) == free + unused
    assert free_device_bytes(torch.device("cpu")) is None


def test_a_recent_free_memory_reading_serves_forwards_that_fit_it(monkeypatch) -> None:
    """The driver is read once per ``READING_TTL_S`` while forwards fit the last reading; a
    forward that does not fit it, or one after the reading expired, reads again."""
    from ep_runtime import rounds

    reads: list[int] = []
    free = {"bytes": 100 << 30}
    clock = {"now": 1000.0}

    def reader(_device: torch.device) -> int:
        reads.append(free["bytes"])
        return free["bytes"]

    monkeypatch.setattr(rounds, "free_device_bytes", reader)
    monkeypatch.setattr(rounds, "clock", lambda: clock["now"])
    per_token = 1 << 20  # 1 MiB a token: 4096 tokens need 4 GiB, above the query floor
    bounds = rounds.RoundBounds.of(None, None, per_token, torch.device("cpu"))
    assert bounds.tokens_per_round(4096) == 4096 and len(reads) == 1
    assert bounds.tokens_per_round(4096) == 4096 and len(reads) == 1  # the reading reused
    assert bounds.tokens_per_round(32) == 32 and len(reads) == 1  # below the floor: no read
    free["bytes"] = 4 << 30  # memory taken since: a forward that fits the old reading
    assert bounds.tokens_per_round(8192) == 8192 and len(reads) == 1  # 8 GiB <= 50 GiB
    assert bounds.tokens_per_round(60 * 1024) == 2048 and len(reads) == 2  # 60 GiB: read again
    clock["now"] += rounds.READING_TTL_S  # expired: the next forward reads again
    assert bounds.tokens_per_round(4096) == 2048 and len(reads) == 3
    other = rounds.RoundBounds.of(None, None, per_token, torch.device("cpu"))
    assert other.tokens_per_round(1024) == 1024 and len(reads) == 4  # a reading per layer
