"""``--elastic --kill-rank``, end to end: one spawn run and one Ray run of 4 CPU ranks in which
rank 2 SIGKILLs itself as iteration 3 starts. Each must exit 0 with the survivors validated
against ``reference_moe``, and its report must say what happened, checked against what can be
counted by hand here: the experts rank 2 held (regenerated from the seed), the slots over three
survivors, the tokens lost, the load measured before the loss (from the same seeded routing)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from ep_runtime.bench.metrics import expert_token_counts
from ep_runtime.eplb import parse_zipf
from ep_runtime.launch import layer_data
from ep_runtime.launch.cli import EXIT_OK, main
from ep_runtime.launch.presets import PRESETS
from tests.support.processes import ray_temp_dirs

WORLD, VICTIM, AT, ITERS = 4, 2, 3, 6
ARGS = ("--dp", str(WORLD), "--elastic", "--kill-rank", f"{VICTIM}@{AT}", "--iters", str(ITERS),
        "--validate-tokens", "32")  # fmt: skip
TINY = PRESETS["tiny"]
CPU = torch.device("cpu")


def _hand_rank_load() -> tuple[float, float]:
    """(busiest rank, mean rank) of one forward on the first placement: every rank's tokens
    routed by the same seeded Zipf(1.2), E/W contiguous experts per rank."""
    counts = [0] * TINY.num_experts
    for rank in range(WORLD):
        ids, _ = layer_data.rank_routing(
            TINY, rank, TINY.tokens_per_rank, 0, CPU, zipf=parse_zipf("zipf:1.2")
        )
        counts = [
            a + b for a, b in zip(counts, expert_token_counts(ids, TINY.num_experts), strict=True)
        ]
    per_rank = TINY.num_experts // WORLD
    ranks = [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(WORLD)]
    return max(ranks), sum(ranks) / WORLD


def _check(data: dict, output: str, launcher: str) -> None:
    """Everything one run must show, in print and in its JSON."""
    survivors = [r for r in range(WORLD) if r != VICTIM]
    assert data["passed"] and data["problems"] == [] and data["launcher"] == launcher
    assert data["survivors"] == survivors and data["lost_ranks"] == [VICTIM]
    [killed] = data["killed"]
    assert killed["rank"] == VICTIM and killed["iteration"] == AT
    [recovery] = data["recoveries"]
    assert recovery["lost"] == [VICTIM] and recovery["members"] == survivors
    assert recovery["failed_iteration"] == AT and recovery["first_forward_passed"]
    # the timeline: every step timed, in order of the kill and within the run
    for key in ("detect_s", "members_s", "reform_s", "rehome_s", "rebuild_s", "first_forward_s"):
        assert 0 < recovery[key] < 10, (key, recovery[key])
    total = recovery["kill_to_first_correct_s"]
    assert max(recovery["detect_s"], recovery["recovery_s"]) < total < 10
    # rank 2's experts came back from the seed; 16 experts padded to 18 slots over 3 ranks
    config = TINY.moe_config()
    assert recovery["regenerated"] == layer_data.local_experts(config, VICTIM, WORLD)
    assert recovery["from_replicas"] == []
    assert sum(recovery["origins"].values()) == 18 and recovery["origins"]["source"] >= 4
    read = sorted(e for experts in recovery["regenerated_by_rank"].values() for e in experts)
    assert set(read) == set(recovery["regenerated"])
    held = [e for s in data["per_rank"] for e in s["placement"]]
    assert set(held) == set(range(TINY.num_experts)) and len(held) == 18
    # lost work: the failed forward on every rank alive then, the victim's iterations left
    tokens = TINY.tokens_per_rank
    [failed] = data["lost_work"]["failed_forwards"]
    assert failed["iteration"] == AT and failed["ranks"] == survivors
    assert data["lost_work"]["tokens"] == len(survivors) * tokens + (ITERS - AT) * tokens
    # the load: measured before the loss (= the hand count), balanced again after it
    busiest, mean = _hand_rank_load()
    before, after = data["load"]["before_measured"], data["load"]["after_measured"]
    assert (before["rank_max"], before["rank_mean"], before["world_size"]) == (busiest, mean, 4)
    assert after["world_size"] == 3 and after["rank_imbalance"] < before["rank_imbalance"]
    for s in data["per_rank"]:
        v = s["validation"]
        assert v["passed"] and v["slots_hold_their_experts"] and v["validated_tokens"] == 32
        assert v["max_rel_err"] <= v["tolerance"]
    printed = [line for line in output.splitlines() if "(raylet)" not in line]
    assert f"Lost: rank {VICTIM}, SIGKILL as iteration {AT} started" in printed
    assert "Recovery 1: survivors 0, 1, 3 are ranks 0-2 of generation 1 (1 attempt)" in printed
    assert any(line.startswith("  kill -> first correct") for line in printed)
    assert printed[-1].startswith(f"PASSED: rank {VICTIM} lost, 3 survivors validated")
    report = printed[next(i for i, line in enumerate(printed) if line.startswith("Elastic EP")) :]
    assert max(map(len, report)) <= 80, report


def test_spawn_elastic_run_survives_a_killed_rank(tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["--launcher", "spawn", *ARGS, "--json", str(report)]) == EXIT_OK
    _check(json.loads(report.read_text()), capsys.readouterr().out, "spawn")


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_ray_elastic_run_survives_a_killed_rank_actor(tmp_path: Path, launcher_runs):
    """The driver hosts the store; the killed actor's ``RayActorError`` is expected and the
    driver goes on with the survivors; nothing of the run is left afterwards."""
    report = tmp_path / "report.json"
    started = time.monotonic()
    run = launcher_runs("--launcher", "ray", *ARGS, "--json", str(report))
    code, output = run.finish(timeout=180)
    assert code == EXIT_OK, output
    assert time.monotonic() - started < 120
    _check(json.loads(report.read_text()), output, "ray")
    run.assert_nothing_left()
    assert ray_temp_dirs(run.process.pid) == []
