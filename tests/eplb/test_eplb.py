"""Expert load balancing in one process: the placement map's invariants, the algorithm against
hand-worked cases and the Zipf load-balance target, the device id map, the move plan, and the
layer at world size 1 (forward vs ``reference_moe`` before and after rebalancing)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ep_runtime import EPInputError, EPMoE, MoEConfig, reference_moe
from ep_runtime.eplb import (
    DeviceMap,
    LoadStats,
    PlacementMap,
    balanced_packing,
    parse_zipf,
    plan_moves,
    rebalanced_placement,
    replicate,
    zipf_routing,
)
from ep_runtime.eplb.algorithm import node_count
from ep_runtime.tolerance import compare_per_token, tolerance_for

CPU = torch.device("cpu")


def test_initial_placement_without_redundancy_is_todays_contiguous_ownership() -> None:
    placement = PlacementMap.initial(8, 0, 4)
    assert placement.slots_per_rank == 2
    assert [placement.experts_on_rank(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert placement.is_identity
    assert placement.logical_to_physical().tolist() == [[e] for e in range(8)]


def test_initial_placement_with_redundancy_adds_replicas_after_every_expert() -> None:
    placement = PlacementMap.initial(6, 3, 3)  # S = 3
    assert placement.physical_to_logical == (0, 1, 2, 3, 4, 5, 0, 1, 2)
    assert placement.replica_counts.tolist() == [2, 2, 2, 1, 1, 1]
    assert placement.logical_to_physical().tolist() == [
        [0, 6], [1, 7], [2, 8], [3, -1], [4, -1], [5, -1]
    ]  # fmt: skip
    assert not placement.is_identity


def test_bad_placement_arguments_are_named() -> None:
    with pytest.raises(EPInputError, match=r"^num_redundant_experts: expected R with \(E \+ R\)"):
        PlacementMap.initial(8, 1, 4)
    with pytest.raises(EPInputError, match=r"^num_redundant_experts: expected an int >= 0"):
        PlacementMap.initial(8, -4, 4)
    with pytest.raises(EPInputError, match=r"^physical_to_logical: expected every logical"):
        PlacementMap(4, 0, 2, (0, 1, 1, 2))
    with pytest.raises(EPInputError, match=r"^physical_to_logical: expected 6 entries"):
        PlacementMap(4, 2, 2, (0, 1, 2, 3))


def test_fold_and_fingerprint() -> None:
    placement = PlacementMap(4, 2, 2, (0, 2, 2, 3, 0, 1))
    assert placement.fold(torch.tensor([5, 3, 4, 4, 6, 2])).tolist() == [11, 2, 7, 4]
    assert placement.rank_load(torch.tensor([5, 3, 4, 4, 6, 2])).tolist() == [12, 12]
    other = PlacementMap(4, 2, 2, (0, 2, 1, 3, 0, 2))
    assert placement.fingerprint() != other.fingerprint()
    assert placement.fingerprint() == PlacementMap(4, 2, 2, (0, 2, 2, 3, 0, 1)).fingerprint()


def test_replicate_and_pack_hand_worked() -> None:
    # load/replica: 10 → 5 (second slot), then max(5, 2, 6, 4) = 6 → expert 2
    assert replicate([10, 2, 6, 4], 6) == [2, 1, 2, 1]
    # items 5, 5, 4, 3, 3, 2 (heaviest first) into the lightest pack with room
    assert balanced_packing([5, 5, 3, 3, 4, 2], 2) == [[0, 4, 5], [1, 2, 3]]


def test_rebalance_hand_worked_keeps_slots_and_moves_one() -> None:
    """E=4, R=2, W=2 (S=3), load [10, 2, 6, 4]. Packs {0, 3, 1} (load 11) and {0, 2, 2}
    (11). Rank 1 holds (3, 0, 1): pack {0, 3, 1} goes there unchanged. Rank 0 holds
    (0, 1, 2) and gets {0, 2, 2}: slot 0 and slot 2 keep 0 and 2, slot 1 receives a second 2
    (a local copy from slot 2)."""
    old = PlacementMap.initial(4, 2, 2)
    assert old.physical_to_logical == (0, 1, 2, 3, 0, 1)
    new = rebalanced_placement(torch.tensor([10, 2, 6, 4]), old)
    assert new.physical_to_logical == (0, 2, 2, 3, 0, 1)
    plan = plan_moves(old, new)
    assert [(m.slot, m.expert, m.source_rank, m.source_slot) for m in plan.moves] == [(1, 2, 0, 2)]
    assert plan.num_local_copies == 1 and not plan.remote
    assert LoadStats.predicted(torch.tensor([10.0, 2, 6, 4]), new).rank_imbalance == 1.0


def _optimal_hottest_replica(load: list[int], num_slots: int) -> float:
    """The least possible max load per replica with ``num_slots`` slots (the oracle): the
    smallest candidate ``l_e / c`` for which ``Σ ceil(l_e / x)`` replicas fit."""
    candidates = sorted({n / c for n in load for c in range(1, num_slots + 1) if n > 0})
    for x in candidates:
        if sum(math.ceil(n / x) if n > 0 else 1 for n in load) <= num_slots:
            return x
    raise AssertionError("no candidate fits")


def _zipf_counts(placement: PlacementMap, tokens_per_rank: int, top_k: int, seed: int):
    """Route every rank's Zipf(1.2) tokens through ``placement`` on the device map (each rank
    with its own seed), returning logical counts and measured per-slot counts."""
    device_map = DeviceMap(placement, CPU)
    logical = torch.zeros(placement.num_logical, dtype=torch.int64)
    measured = torch.zeros(placement.num_physical, dtype=torch.int64)
    for rank in range(placement.world_size):
        ids, _ = zipf_routing(
            tokens_per_rank, placement.num_logical, top_k, 1.2, seed=seed, rank=rank
        )
        logical += torch.bincount(ids.flatten().long(), minlength=placement.num_logical)
        physical = device_map.to_physical(ids, seed=rank).flatten().long()
        measured += torch.bincount(physical, minlength=placement.num_physical)
    return logical, measured


@pytest.mark.parametrize("num_nodes", [1, 2])
def test_zipf_target_e64_w8_r8_k8_t4096(num_nodes: int) -> None:
    """Zipf(1.2) popularity, E=64, W=8, R=8, K=8, T=4096 (512 per rank): one rebalance brings
    the busiest rank to ≤ 1.08× the mean rank (measured by routing the same tokens through the
    new map), and the hottest slot to the least possible max load per replica (the oracle);
    the measured slot load differs from that by at most the per-rank rounding of the replica
    split."""
    world, tokens, top_k = 8, 512, 8
    old = PlacementMap.initial(64, 8, world)
    logical, measured_before = _zipf_counts(old, tokens, top_k, seed=0)
    before = LoadStats.of_slots(measured_before, old)
    assert before.rank_imbalance > 1.3  # the skew is real
    new = rebalanced_placement(logical, old, num_nodes=num_nodes)
    _, measured_after = _zipf_counts(new, tokens, top_k, seed=0)
    after = LoadStats.of_slots(measured_after, new)
    assert after.rank_imbalance <= 1.08, after.line("after")
    optimum = _optimal_hottest_replica(logical.tolist(), 72) if num_nodes == 1 else None
    predicted = LoadStats.predicted(logical, new)
    if optimum is not None:
        assert predicted.slot_max == pytest.approx(optimum)
        assert after.slot_max <= optimum + world
    if num_nodes == 2:  # every replica of an expert stays on its node (ranks 0-3 or 4-7)
        for slots in new.replicas:
            assert len({slot // 36 for slot in slots}) == 1


def test_algorithm_is_deterministic_and_stable() -> None:
    old = PlacementMap.initial(64, 8, 8)
    load = torch.bincount(zipf_routing(4096, 64, 8, 1.2, seed=3)[0].flatten().long(), minlength=64)
    first = rebalanced_placement(load, old)
    assert rebalanced_placement(load, old) == first
    again = rebalanced_placement(load, first)  # the same load again: nothing moves
    assert again == first and not plan_moves(first, again).moves


def test_moves_only_changed_slots_and_keeps_what_stays() -> None:
    old = PlacementMap.initial(16, 4, 4)
    load = torch.bincount(zipf_routing(1000, 16, 4, 1.2, seed=5)[0].flatten().long(), minlength=16)
    new = rebalanced_placement(load, old)
    plan = plan_moves(old, new)
    assert [m.slot for m in plan.moves] == old.changed_slots(new)
    for rank in range(4):  # per rank, only the experts it did not hold before arrive
        kept = Counter(old.experts_on_rank(rank)) & Counter(new.experts_on_rank(rank))
        arriving = [m for m in plan.moves if new.rank_of_slot(m.slot) == rank]
        assert len(arriving) == old.slots_per_rank - sum(kept.values())
    for move in plan.moves:
        assert old.physical_to_logical[move.source_slot] == move.expert
        assert new.physical_to_logical[move.slot] == move.expert


def test_hierarchy_needs_contiguous_equal_nodes() -> None:
    assert node_count(["a", "a", "b", "b"]) == 2
    assert node_count(["a", "b", "a", "b"]) == 1
    assert node_count(["a", "a", "a", "b"]) == 1
    assert node_count(["a"] * 4) == 1


def test_device_map_picks_a_replica_of_the_right_expert() -> None:
    placement = PlacementMap(4, 4, 2, (0, 0, 1, 2, 3, 0, 1, 0))  # expert 0 in 4 slots
    device_map = DeviceMap(placement, CPU)
    ids = torch.tensor([[0, 1], [0, -1], [0, 3], [0, 2], [5, 0], [-3, -1], [2, 2]])
    physical = device_map.to_physical(ids, seed=0)
    assert physical.dtype == torch.int32
    p2l = torch.tensor(placement.physical_to_logical)
    valid = (ids >= 0) & (ids < 4)
    assert torch.equal(p2l[physical[valid].long()], ids[valid])
    assert physical[ids == -1].eq(-1).all()
    assert physical[4, 0] == 8 and physical[5, 0] == 8  # out of range: E + R, refused later
    assert physical[6, 0] == physical[6, 1]  # a repeated id stays repeated
    # expert 0 of tokens 0..3 goes to replicas (t + 0) mod 4: all four slots once
    assert sorted(physical[:4, 0].tolist()) == [0, 1, 5, 7]
    device_map.load += torch.arange(8)  # what the route added
    assert torch.equal(device_map.take_load(reset=False), torch.arange(8))
    assert device_map.take_load(reset=True).sum() == 28 and device_map.take_load(True).sum() == 0


def test_device_map_install_keeps_storage() -> None:
    old = PlacementMap.initial(8, 4, 4)
    device_map = DeviceMap(old, CPU)
    table, counts = device_map.table.data_ptr(), device_map.counts.data_ptr()
    new = rebalanced_placement(torch.arange(8) ** 2, old)
    staged = device_map.tables(new)
    assert torch.equal(device_map.table, old.logical_to_physical(5))  # staging changes nothing
    device_map.load += 3
    device_map.install(new, *staged)
    assert (device_map.table.data_ptr(), device_map.counts.data_ptr()) == (table, counts)
    assert torch.equal(device_map.table, new.logical_to_physical(5))
    assert torch.equal(device_map.counts, new.replica_counts)
    assert int(device_map.load.sum()) == 0  # a new placement starts a new window


def test_zipf_routing_is_seeded_and_distinct() -> None:
    ids, weights = zipf_routing(64, 16, 4, 1.2, seed=7, rank=1)
    again, _ = zipf_routing(64, 16, 4, 1.2, seed=7, rank=1)
    other_rank, _ = zipf_routing(64, 16, 4, 1.2, seed=7, rank=2)
    assert torch.equal(ids, again) and not torch.equal(ids, other_rank)
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert torch.allclose(weights.sum(1), torch.ones(64))
    assert parse_zipf("zipf:1.2") == 1.2 and parse_zipf("random") is None
    for bad in ("zipf:", "zipf:-1", "zipf:abc", "zipf:inf"):
        with pytest.raises(EPInputError, match=r"^routing: expected zipf:S"):
            parse_zipf(bad)


CFG = MoEConfig(num_experts=8, top_k=3, hidden_size=32, intermediate_size=16, dtype=torch.float32)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(8, 32, 32, generator=generator) / 32**0.5
    w2 = torch.randn(8, 32, 16, generator=generator) / 16**0.5
    return w13, w2


def _inputs(num_tokens: int = 40, seed: int = 1):
    ids, weights = zipf_routing(num_tokens, 8, 3, 1.2, seed=seed)
    ids[::7, 1] = -1
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(seed))
    return x, ids, weights


def _assert_matches(out, x, ids, weights, w13, w2) -> None:
    ref, scale = reference_moe(x, ids, weights, w13, w2, return_scale=True)
    comparison = compare_per_token(out, ref, tolerance_for(torch.float32, 32), scale)
    assert comparison.passed, comparison.describe()


@pytest.mark.parametrize("redundant", [0, 1, 4])
@pytest.mark.parametrize("layout", ["standard", "expanded"])
@pytest.mark.parametrize("mode", ["exact", "capacity"])
def test_layer_world_of_one_before_and_after_rebalance(redundant, layout, mode) -> None:
    w13, w2 = _weights()
    x, ids, weights = _inputs()
    layer = EPMoE(
        CFG, layout=layout, mode=mode, device="cpu", num_redundant_experts=redundant,
        max_tokens_per_rank=64,
    )  # fmt: skip
    try:
        layer.load_weights(w13, w2)
        assert layer.placement.num_physical == 8 + redundant
        _assert_matches(layer(x, ids, weights), x, ids, weights, w13, w2)
        load = layer.expert_load()
        assert load.dtype == torch.int64 and load.shape == (8 + redundant,)
        hand_count = torch.bincount(ids[ids >= 0].long(), minlength=8)
        assert torch.equal(layer.placement.fold(load), hand_count)
        report = layer.rebalance()
        assert report.changed_slots == report.local_copies  # one rank: no bytes sent
        assert report.bytes_moved == 0
        assert layer.expert_load().sum() == 0  # a rebalance starts a new window
        _assert_matches(layer(x, ids, weights), x, ids, weights, w13, w2)
        slot13, _ = layer.eplb.slot_weights
        for slot, expert in enumerate(layer.placement.physical_to_logical):
            assert torch.equal(slot13[slot], w13[expert])
        if redundant:  # the hottest expert got a replica, and both serve tokens
            hottest = int(hand_count.argmax())
            assert len(layer.placement.replicas[hottest]) > 1
            served = layer.expert_load()[list(layer.placement.replicas[hottest])]
            assert (served > 0).all()
    finally:
        layer.close()


def test_two_identical_runs_are_bitwise_equal() -> None:
    def run() -> list[torch.Tensor]:
        layer = EPMoE(CFG, device="cpu", num_redundant_experts=4)
        try:
            layer.load_weights(*_weights())
            outputs = []
            for seed in (1, 2, 3):
                outputs.append(layer(*_inputs(seed=seed)))
                layer.rebalance()
            return outputs
        finally:
            layer.close()

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_eplb_interval_rebalances_every_n_forwards() -> None:
    layer = EPMoE(CFG, device="cpu", num_redundant_experts=4, eplb_interval=2)
    try:
        layer.load_weights(*_weights())
        layer(*_inputs(seed=1))
        assert not layer.eplb.reports and layer.expert_load().sum() > 0
        layer(*_inputs(seed=2))
        assert len(layer.eplb.reports) == 1 and layer.expert_load().sum() == 0
        assert layer.placement != PlacementMap.initial(8, 4, 1)
    finally:
        layer.close()


def test_local_shard_is_taken_as_is_without_redundancy() -> None:
    w13, w2 = _weights()
    layer = EPMoE(CFG, device="cpu")
    try:
        layer.load_weights(w13, w2)  # world of 1: [E] is the whole shard
        x, ids, weights = _inputs()
        _assert_matches(layer(x, ids, weights), x, ids, weights, w13, w2)
    finally:
        layer.close()


def test_bad_eplb_arguments_are_named() -> None:
    with pytest.raises(EPInputError, match=r"^num_redundant_experts: expected an int >= 0"):
        EPMoE(CFG, device="cpu", num_redundant_experts=-1)
    with pytest.raises(EPInputError, match=r"^eplb_interval: expected a positive int"):
        EPMoE(CFG, device="cpu", eplb_interval=0)
    layer = EPMoE(CFG, device="cpu", num_redundant_experts=2)
    try:
        with pytest.raises(RuntimeError, match=r"load_weights\(\) must be called"):
            layer.rebalance()
        w13, w2 = _weights()
        with pytest.raises(EPInputError, match=r"^w13: expected \[E=8, \.\.\.\] global"):
            layer.load_weights(w13[:3], w2[:3])
        with pytest.raises(EPInputError, match=r"^w2: expected \[8, H, I\]"):
            layer.load_weights(w13, w2[:3])
        layer.load_weights(w13, w2)
        with pytest.raises(EPInputError, match=r"^load: expected \[E \+ R = 10\] per slot"):
            layer.rebalance(torch.ones(9))
        with pytest.raises(EPInputError, match=r"^load: expected finite, non-negative"):
            layer.rebalance(torch.tensor([1.0] * 7 + [-1.0]))
        before = layer.placement
        layer.rebalance(torch.arange(8.0))  # [E] logical load is accepted
        assert layer.placement != before
    finally:
        layer.close()


def test_bad_logical_ids_still_fail_the_forward() -> None:
    layer = EPMoE(CFG, device="cpu", num_redundant_experts=2)
    try:
        layer.load_weights(*_weights())
        x, ids, weights = _inputs()
        ids[3, 0] = 8
        with pytest.raises(EPInputError, match=r"^topk_ids: expected values in"):
            layer(x, ids, weights)
    finally:
        layer.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_cuda_capacity_forward_with_the_map_syncs_nothing_and_replays_bitwise() -> None:
    """Capacity mode, W = 1, R = 4 replicas: a forward makes no host sync; a captured forward
    replays bitwise equal to eager, also after a rebalance (the map's tables and the slot
    weights are updated in place, so the graph follows)."""
    config = MoEConfig(num_experts=8, top_k=3, hidden_size=256, intermediate_size=64)
    layer = EPMoE(config, mode="capacity", num_redundant_experts=4, max_tokens_per_rank=40)
    try:
        generator = torch.Generator().manual_seed(0)
        w13 = torch.randn(8, 128, 256, generator=generator) / 16
        w2 = torch.randn(8, 256, 64, generator=generator) / 8
        layer.load_weights(w13.to(torch.bfloat16).cuda(), w2.to(torch.bfloat16).cuda())
        _, ids, weights = _inputs()
        x = torch.randn(40, 256, generator=generator).to(torch.bfloat16).cuda()
        ids, weights = ids.cuda(), weights.cuda()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                layer(x, ids, weights)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = layer(x, ids, weights)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(x, ids, weights)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        layer.rebalance()
        after = layer(x, ids, weights)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, after)
        layer.check()
    finally:
        layer.close()


def test_weights_are_says_global_or_slots_and_checks_the_size() -> None:
    """W = 1, E = 8, R = 2: S = 10. After a rebalance, reloading ``[S]`` slot weights in the
    new slot order (``weights_are="slots"``) and the global ``[E]`` ones (``"global"``, and
    ``"auto"``) give the reference output; a size that does not match the named kind, or an
    unknown kind, is refused naming the argument."""
    w13, w2 = _weights()
    x, ids, weights = _inputs()
    layer = EPMoE(CFG, device="cpu", num_redundant_experts=2)
    try:
        layer.load_weights(w13, w2, weights_are="global")
        layer.rebalance(torch.arange(8.0) ** 2)  # moves replicas onto the heaviest experts
        slots = list(layer.placement.experts_on_rank(0))
        assert slots != list(PlacementMap.initial(8, 2, 1).experts_on_rank(0))
        for given, kind in (((w13[slots], w2[slots]), "slots"), ((w13, w2), "global")):
            layer.load_weights(*given, weights_are=kind)
            _assert_matches(layer(x, ids, weights), x, ids, weights, w13, w2)
        layer.load_weights(w13, w2)  # auto: [E] is global
        _assert_matches(layer(x, ids, weights), x, ids, weights, w13, w2)
        with pytest.raises(
            EPInputError, match=r"^w13: expected \[S=10, \.\.\.\] this rank's slots"
        ):
            layer.load_weights(w13, w2, weights_are="slots")
        with pytest.raises(EPInputError, match=r"^w13: expected \[E=8, \.\.\.\] global experts"):
            layer.load_weights(w13[slots], w2[slots], weights_are="global")
        with pytest.raises(EPInputError, match=r"^weights_are: expected one of 'auto', 'global'"):
            layer.load_weights(w13, w2, weights_are="shard")
    finally:
        layer.close()
