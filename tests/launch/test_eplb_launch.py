"""Expert load balancing through the launcher: ``--routing zipf:S``, ``--redundant-experts R``,
``--rebalance-every N``. A spawn run validated against ``reference_moe`` before and after
rebalancing, its first-window load recounted here by hand from the documented replica rule, and
bad values refused in one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ep_runtime.eplb import PlacementMap, zipf_routing
from ep_runtime.launch import cli, layer_data
from ep_runtime.launch.cli import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, main
from ep_runtime.launch.presets import PRESETS

CPU = torch.device("cpu")
TINY = PRESETS["tiny"]  # E = 16, K = 4, T = 64 per rank


def test_zipf_routing_and_slots_of_the_launchers_workload() -> None:
    ids, weights = layer_data.rank_routing(TINY, 1, 32, 5, CPU, zipf=1.2)
    want_ids, want_weights = zipf_routing(32, 16, 4, 1.2, seed=5, rank=1)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    config = TINY.moe_config()
    # E + R = 18 slots over 2 ranks: rank 1 holds experts 9..15, then the replicas of 0 and 1
    assert layer_data.local_experts(config, 1, 2, num_redundant=2) == [*range(9, 16), 0, 1]
    assert layer_data.local_experts(config, 1, 2) == list(range(8, 16))
    per_expert = (2 * 256 + 256) * 128 * 4  # w13 [512, 128] + w2 [128, 256], fp32
    assert layer_data.shard_weight_bytes(config, 2, torch.float32, 2) == 9 * per_expert


def test_slots_hold_experts_catches_a_misplaced_slot() -> None:
    config = TINY.with_overrides(hidden_size=16, intermediate_size=8).moe_config()
    experts = [3, 0, 3]
    weights = layer_data.stacked_expert_weights(config, experts, 0, CPU, torch.float32)
    assert layer_data.slots_hold_experts(config, weights, experts, 0)
    assert not layer_data.slots_hold_experts(config, weights, [3, 1, 3], 0)
    assert not layer_data.slots_hold_experts(config, weights, experts, 1)  # another seed


def _first_window_by_hand(world: int, redundant: int, seed: int) -> tuple[list[int], list[int]]:
    """Per-slot and per-rank (token, slot) pairs of one forward on the initial placement, by
    the rule of docs/eplb.md: slot p holds expert p mod E; token t of rank r sends expert e to
    replica (t + e + r) mod count[e]."""
    num_experts, num_slots = TINY.num_experts, TINY.num_experts + redundant
    replicas = [[p for p in range(num_slots) if p % num_experts == e] for e in range(num_experts)]
    slot_load = [0] * num_slots
    for rank in range(world):
        ids, _ = zipf_routing(
            TINY.tokens_per_rank, num_experts, TINY.top_k, 1.2, seed=seed, rank=rank
        )
        for token, row in enumerate(ids.tolist()):
            for expert in row:
                copies = replicas[expert]
                slot_load[copies[(token + expert + rank) % len(copies)]] += 1
    per_rank = num_slots // world
    rank_load = [sum(slot_load[r * per_rank : (r + 1) * per_rank]) for r in range(world)]
    return slot_load, rank_load


def test_spawn_run_rebalances_and_validates_before_and_after(tmp_path: Path, capsys) -> None:
    report_path = tmp_path / "report.json"
    argv = ["--launcher", "spawn", "--dp", "2", "--routing", "zipf:1.2"]
    argv += ["--redundant-experts", "2", "--rebalance-every", "2", "--iters", "4", "--warmup", "1"]
    code = main([*argv, "--no-baselines", "--json", str(report_path)])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    report = json.loads(report_path.read_text())
    assert report["passed"]
    eplb = report["cases"][0]["eplb"]
    for line in eplb["lines"]:  # printed as they are
        assert line in out
    assert eplb["lines"][0].startswith("expert load (first window): busiest rank ")
    assert eplb["lines"][1].startswith("expert load (after rebalancing): busiest rank ")
    assert eplb["lines"][2].startswith("rebalances: 2, ")
    # the first window, recounted by hand (one forward's worth)
    slot_load, rank_load = _first_window_by_hand(2, 2, seed=0)
    before, after = eplb["before"], eplb["after"]
    assert before["rank_max"] == max(rank_load) and before["slot_max"] == max(slot_load)
    pairs = 2 * TINY.tokens_per_rank * TINY.top_k
    assert before["rank_mean"] == after["rank_mean"] == pairs / 2
    assert eplb["rank_imbalance_after"] < eplb["rank_imbalance_before"]
    assert eplb["slot_imbalance_after"] < eplb["slot_imbalance_before"]
    first, second = eplb["rebalances"]
    assert first["changed_slots"] > 0 and first["bytes_moved"] > 0
    assert second["changed_slots"] == 0 and second["bytes_moved"] == 0  # the same load again
    initial = PlacementMap.initial(16, 2, 2)
    measured_rank_loads, moved = [], []
    for rank, entry in enumerate(report["per_rank"]):
        (validation,) = entry["validation"]
        assert validation["passed"] and validation["slots_hold_their_experts"]
        assert validation["before_rebalance"]["passed"]
        assert validation["before_rebalance"]["placement"] == list(initial.experts_on_rank(rank))
        assert validation["placement"] == entry["local_experts"]
        moved.append(entry["local_experts"] != list(initial.experts_on_rank(rank)))
        assert len(entry["local_expert_counts"]) == 9  # one count per slot
        measured_rank_loads.append(entry["valid_pairs"])
    assert any(moved)
    assert sum(measured_rank_loads) == pairs and max(measured_rank_loads) == after["rank_max"]
    assert report["spec"]["routing"] == "zipf:1.2" and report["spec"]["redundant_experts"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--routing", "zipf:0"], "--routing: expected zipf:S with a finite exponent S > 0, "
         "given 'zipf:0'"),
        (["--routing", "zipf:x"], "--routing: expected zipf:S with a finite exponent S > 0"),
        (["--routing", "uniform"], "--routing: expected model or zipf:S (S > 0), given 'uniform'"),
        (["--redundant-experts", "-1"], "--redundant-experts: expected >= 0, given -1"),
        (["--redundant-experts", "3"], "--redundant-experts: expected R with E + R a multiple of "
         "--dp 2 (E = 16), given 3"),
        (["--rebalance-every", "0"], "--rebalance-every: expected >= 1 iterations, given 0"),
        (["--hf-model", "mixtral", "--redundant-experts", "2"], "--redundant-experts: expected "
         "none with --hf-model (the synthetic layer's option), given 2"),
    ],
)  # fmt: skip
def test_bad_balancing_values_exit_2_with_one_line(argv, message, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "_launch", lambda *args: pytest.fail("a run was started"))
    assert main(["--launcher", "spawn", "--dp", "2", *argv]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert out.startswith(f"error: {message}"), out
    assert out.count("\n") == 1, out


def test_redundant_slots_lift_the_experts_divisibility(capsys, monkeypatch) -> None:
    """16 experts over 3 ranks: refused alone, accepted with R = 2 (18 slots)."""
    monkeypatch.setattr(cli, "_launch", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["--launcher", "spawn", "--dp", "3"]) == EXIT_USAGE
    assert "--dp: expected a divisor of the 16 experts" in capsys.readouterr().out
    assert main(["--launcher", "spawn", "--dp", "3", "--redundant-experts", "2"]) == (
        EXIT_INTERRUPTED
    )
