"""The re-homing plan after a rank loss (ep_runtime/elastic/rehome.py), against hand counts: the
padded slot count, each slot's source, the balance it gives a skewed load, the experts that are
gone, and the weights it assembles (a round trip through a world of one)."""

from __future__ import annotations

import pytest
import torch

from ep_runtime.comm import SingleRankComm
from ep_runtime.elastic import LostExpertsError
from ep_runtime.elastic.rehome import (
    Holding,
    Origin,
    exchange_and_assemble,
    padded_redundancy,
    plan_rehome,
    read_from_source,
)
from ep_runtime.eplb import LoadStats, zipf_popularity

SHAPE = (8, 4, 3, 2)  # E, rows, H, I


def holding(experts, load=None, source=True, shape=SHAPE):
    load = load if load is not None else [0.0] * shape[0]
    return Holding(shape, tuple(experts), tuple(load), source)


@pytest.mark.parametrize(
    ("experts", "redundant", "world", "expected"),
    [(32, 0, 3, 1), (32, 4, 3, 4), (32, 0, 4, 0), (8, 1, 2, 2), (8, 0, 5, 2), (7, 0, 1, 0)],
)
def test_padded_redundancy_is_the_least_that_the_survivors_divide(
    experts, redundant, world, expected
):
    assert padded_redundancy(experts, redundant, world) == expected
    assert (experts + expected) % world == 0


def test_survivors_keep_what_they_hold_and_the_lost_experts_are_read():
    # 4 ranks of 2 slots; rank 2 (experts 4, 5) is lost: survivors hold 0-3 and 6-7
    held = [(0, 1), (2, 3), (6, 7)]
    plan = plan_rehome(0, [holding(h) for h in held], num_redundant=0)
    assert plan.placement.world_size == 3
    assert plan.placement.num_redundant == 1  # 9 slots, 3 per survivor
    assert sorted(set(plan.placement.physical_to_logical)) == list(range(8))
    for slot, source in enumerate(plan.sources):
        expert = plan.placement.physical_to_logical[slot]
        rank = plan.placement.rank_of_slot(slot)
        if expert in held[rank]:
            assert source.origin is Origin.KEPT and held[rank][source.slot] == expert
        elif any(expert in h for h in held):
            assert source.origin is Origin.MOVED and held[source.member][source.slot] == expert
        else:
            assert expert in (4, 5) and source.origin is Origin.SOURCE
    counts = plan.counts()
    assert counts["source"] >= 2 and sum(counts.values()) == 9


def test_a_lost_expert_without_source_or_replica_is_named():
    held = [(0, 1), (2, 3), (6, 7)]
    with pytest.raises(LostExpertsError, match=r"experts \[4, 5\]") as caught:
        plan_rehome(3, [holding(h, source=i != 1) for i, h in enumerate(held)], num_redundant=0)
    assert caught.value.layer == 3 and caught.value.experts == (4, 5)


def test_a_replica_on_a_survivor_needs_no_source():
    # expert 4 was replicated on rank 0, expert 5 on rank 1: nothing is gone
    held = [(0, 1, 4), (2, 3, 5), (6, 7, 0)]
    plan = plan_rehome(0, [holding(h, source=False) for h in held], num_redundant=1)
    assert all(s.origin is not Origin.SOURCE for s in plan.sources)


def test_the_new_placement_balances_the_load_the_survivors_counted():
    popularity = zipf_popularity(32, 1.2, seed=7)
    load = (popularity * 3000).tolist()
    held = [tuple(range(r * 8, (r + 1) * 8)) for r in (0, 1, 3)]  # rank 2 lost
    # each survivor counted a third of the load
    plan = plan_rehome(0, [holding(h, [v / 3 for v in load], shape=(32, 4, 3, 2)) for h in held], 0)
    after = LoadStats.predicted(torch.tensor(plan.load, dtype=torch.float64), plan.placement)
    assert after.rank_imbalance <= 1.15
    assert plan.load == pytest.approx(load)


def test_nothing_counted_gives_uniform_load():
    plan = plan_rehome(0, [holding((0, 1, 2, 3)), holding((4, 5, 6, 7))], 0)
    assert plan.load == (1.0,) * 8


def test_different_shapes_are_refused():
    with pytest.raises(Exception, match="same shape"):
        plan_rehome(0, [holding((0,)), holding((1,), shape=(8, 4, 3, 4))], 0)


def test_assembly_round_trip_in_a_world_of_one():
    """One survivor of two (rank 1 with experts 4-7 lost): kept rows are this rank's own,
    read rows come from the source, bitwise."""
    generator = torch.Generator().manual_seed(0)
    w13 = torch.randn(8, 4, 3, generator=generator)
    w2 = torch.randn(8, 3, 2, generator=generator)
    plan = plan_rehome(0, [holding((0, 1, 2, 3))], 0)
    source = lambda ids: (w13[list(ids)], w2[list(ids)])  # noqa: E731
    comm = SingleRankComm(torch.device("cpu"))
    read = read_from_source(plan, 0, source, w13)
    new13, new2 = exchange_and_assemble(comm, plan, w13[:4], w2[:4], read)
    experts = plan.placement.experts_on_rank(0)
    assert torch.equal(new13, w13[list(experts)]) and torch.equal(new2, w2[list(experts)])


def test_a_source_giving_the_wrong_count_is_named():
    plan = plan_rehome(0, [holding((0, 1, 2, 3))], 0)
    w13 = torch.zeros(8, 4, 3)
    with pytest.raises(Exception, match="weight_source"):
        read_from_source(plan, 0, lambda ids: (w13[:1], w13[:1]), w13)
