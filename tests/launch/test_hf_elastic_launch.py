"""``--hf-model --elastic --kill-rank``: one spawn run of 3 CPU ranks of the tiny qwen3-moe in
which rank 1 SIGKILLs itself in lockstep step 4, checked against what is known here: the
survivors' tokens are the unpatched model's (transformers' own greedy ``generate`` in this
process), rank 1's experts (4-7 of 12, in each of the 2 blocks) are the ones read again, its
request is listed as lost, and the report says so within 80 columns with the verdict last. Then
the report's negative control (a kill that was not recorded fails the run) and the argument
checks, without starting a process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from ep_runtime.launch import cli
from ep_runtime.launch.cli import EXIT_OK, EXIT_USAGE, build_parser, main
from ep_runtime.launch.elastic_run import KillAt
from tests.launch.test_launch_report import _hf_report, _table_rows
from tests.support.hf_oracle import hf_greedy, model_eos, needs_transformers

pytestmark = needs_transformers
WORLD, VICTIM, STEP, NEW_TOKENS = 3, 1, 4, 5
ARGS = ("--dp", str(WORLD), "--device", "cpu", "--hf-model", "qwen3-moe", "--elastic",
        "--kill-rank", f"{VICTIM}@{STEP}", "--hf-new-tokens", str(NEW_TOKENS),
        "--warmup", "0")  # fmt: skip
SURVIVORS = [0, 2]


def test_spawn_hf_run_survives_a_rank_killed_mid_generation(tmp_path: Path, capsys) -> None:
    from ep_runtime.integrations.transformers import build_random_model, random_config
    from ep_runtime.launch.hf_report import print_hf_report

    path = tmp_path / "report.json"
    code = main(["--launcher", "spawn", *ARGS, "--json", str(path)])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    report = json.loads(path.read_text())
    elastic = report["elastic"]
    assert report["passed"] and elastic["problems"] == [] and report["world_size"] == WORLD
    assert elastic["lost_ranks"] == [VICTIM] and elastic["survivors"] == SURVIVORS
    [killed] = elastic["killed"]
    assert (killed["rank"], killed["step"]) == (VICTIM, STEP)
    # the lost request, listed: rank 1's prompt (8 + 3) and its budget (5 + 2)
    assert elastic["lost_requests"] == [
        {"rank": VICTIM, "step": STEP, "prompt_tokens": 11, "max_new_tokens": 7, "served": False}
    ]
    # the survivors' tokens: the unpatched model's, computed here
    reference = build_random_model(random_config("qwen3-moe"), seed=0)
    eos = model_eos(reference)
    ranks = report["per_rank"]
    assert [r["rank"] for r in ranks] == SURVIVORS
    for rank in ranks:
        tokens, _ = hf_greedy(reference, rank["prompt"], rank["max_new_tokens"], eos)
        assert rank["tokens"] == tokens, rank["rank"]
        assert rank["validation"]["tokens_match"] and rank["validation"]["passed"]
        assert rank["lost_ranks"] == [VICTIM] and rank["members"] == SURVIVORS
        assert rank["retried_steps"] == 1 and rank["new_rank"] == SURVIVORS.index(rank["rank"])
    # 12 experts over 3 ranks: rank 1 held 4-7 of each block; the survivors hold all 12 after
    held = sorted(e for r in ranks for e in r["local_experts"])
    assert held == list(range(12))
    [recovery] = elastic["recoveries"]
    assert recovery["lost"] == [VICTIM] and recovery["members"] == SURVIVORS
    assert recovery["from_source"] == [[4, 5, 6, 7]] * 2 and recovery["from_replicas"] == [[]] * 2
    assert recovery["step_run_again"] == STEP and sum(recovery["origins"].values()) == 24
    # the timeline: in the order of the events, every part timed
    assert 0 < recovery["recovery_s"] < recovery["serving_again_s"]
    assert 0 < recovery["step_again_s"] < recovery["kill_to_step_done_s"] < 30
    assert recovery["serving_again_s"] < recovery["kill_to_step_done_s"]
    # printed: the lost rank's rows, the loss, the timeline; the verdict last, in 80 columns
    printed = out.strip().splitlines()
    assert printed[-1].startswith(f"PASSED: rank {VICTIM} lost at step {STEP}; survivors' tokens")
    section = printed[next(i for i, line in enumerate(printed) if line.startswith("Lost: ")) :]
    assert section[0] == f"Lost: rank {VICTIM}, SIGKILLed in step {STEP}, and its request " + (
        "(prompt 11, up to 7 tokens)"
    )
    assert "Recovery 1: survivors 0, 2 are ranks 0, 1 of generation 1 (1 attempt)" in section
    assert any(line.startswith(f"  kill -> step {STEP} done") for line in section)
    assert max(map(len, section)) <= 80, section
    terminal = Console(width=80, record=True, force_terminal=True, color_system=None)
    print_hf_report(report, terminal)  # the whole report, as an 80-column terminal shows it
    text = terminal.export_text()
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text, text
    generation = _table_rows(text, "Generation: each rank its own request")
    assert generation[VICTIM] == [str(VICTIM), "11", "lost", *["-"] * 5]
    held_rows = _table_rows(text, "Experts, memory and validation")
    assert held_rows[VICTIM][-2:] == ["lost", f"@{STEP}"]


# the report's negative control -------------------------------------------------------------------
def _elastic_report(recorded: bool) -> dict:
    """The report of a W=3 run that lost rank 1 in step 4, from made-up survivor summaries;
    ``recorded``: whether rank 1 wrote its kill into the store before it died."""
    from ep_runtime.launch.hf_report import build_hf_report
    from ep_runtime.launch.hf_run import HFWorkload
    from ep_runtime.launch.presets import ModelPreset, RouterSpec
    from ep_runtime.launch.spec import RunSpec

    base = _hf_report(world=WORLD)
    model = ModelPreset("qwen3-moe", 64, 12, 3, 32, "silu", RouterSpec(), 14)
    workload = HFWorkload(
        "qwen3-moe", model, (8, 11, 14), (12, 14, 16), elastic=True, kills=(KillAt(VICTIM, STEP),)
    )
    stats = {"rank_max": 1.0, "rank_mean": 1.0}
    layer = {"origins": {"kept": 8, "moved": 0, "source": 4}, "from_replicas": [],
             "from_source": [4, 5, 6, 7], "before": stats, "after": stats}  # fmt: skip
    recovery = {"generation": 1, "lost": [VICTIM], "members": SURVIVORS, "attempts": 1,
                "members_s": 0.02, "reform_s": 0.03, "rehome_s": 0.04, "rebuild_s": 0.05,
                "total_s": 0.14, "layers": [layer, layer], "lines": [], "resumed_at": 100.2,
                "step": STEP, "done_at": 100.3}  # fmt: skip
    kills = [{"rank": VICTIM, "step": STEP, "at": 100.0}] if recorded else []
    elastic = {"kills": kills, "recoveries": [recovery], "lost_ranks": [VICTIM],
               "retried_steps": 1, "members": SURVIVORS}  # fmt: skip
    survivors = [r for r in base["per_rank"] if r["rank"] != VICTIM]
    summaries = [row | elastic | {"new_rank": index} for index, row in enumerate(survivors)]
    validations = [row["validation"] for row in summaries]
    return build_hf_report(RunSpec(WORLD, "cpu", workload), "spawn", summaries, 1.0, validations)


@pytest.mark.parametrize("recorded", [True, False])
def test_an_unrecorded_kill_fails_the_hf_elastic_report(recorded: bool) -> None:
    from ep_runtime.launch.hf_report import hf_verdict_line, print_hf_report

    report = _elastic_report(recorded)
    console = Console(width=80, record=True, force_terminal=True, color_system=None)
    print_hf_report(report, console)
    lines = console.export_text().strip().splitlines()
    assert max(map(len, lines)) <= 80
    assert lines[-1] == hf_verdict_line(report)
    [recovery] = report["elastic"]["recoveries"]
    assert recovery["origins"] == {"kept": 16, "moved": 0, "source": 8}  # both blocks
    if recorded:
        assert report["passed"] and report["elastic"]["problems"] == []
        assert lines[-1] == "PASSED: rank 1 lost at step 4; survivors' tokens as transformers' " + (
            "(err 4.8e-07)"
        )
        assert (recovery["serving_again_s"], recovery["kill_to_step_done_s"]) == pytest.approx(
            (0.2, 0.3)
        )
    else:
        assert not report["passed"]
        assert report["elastic"]["problems"] == ["rank 1 did not record its kill (told: step 4)"]
        assert "problem: rank 1 did not record its kill (told: step 4)" in lines
        assert lines[-1] == "FAILED: rank 1 lost at step 4; 1 problem(s) above"
        assert recovery["serving_again_s"] is None  # no kill time to measure from


# arguments ---------------------------------------------------------------------------------------
LONGEST = "step 1 is the prefill; rank 2's request, the longest, runs 16"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--kill-rank", "1@0"],
         f"--kill-rank: expected a lockstep step in [1, 17) ({LONGEST}), given 0 (in 1@0)"),
        (["--kill-rank", "1@17"],
         f"--kill-rank: expected a lockstep step in [1, 17) ({LONGEST}), given 17 (in 1@17)"),
        (["--hf-idle-rank", "2", "--kill-rank", "0@15"],
         "--kill-rank: expected a lockstep step in [1, 15) (step 1 is the prefill; rank 1's "
         "request, the longest, runs 14), given 15 (in 0@15)"),
        (["--kill-rank", "3@4"],
         "--kill-rank: expected a rank in [0, 3) (--dp 3), given 3 (in 3@4)"),
        (["--kill-rank", "0@2,1@2,2@2"],
         "--kill-rank: expected a rank left alive, given all 3 ranks killed"),
        (["--dispatcher", "torch_symm_mem"],
         "--dispatcher: expected one that is built again on a re-formed group with --elastic "
         "(deepep_v2, local, torch_a2a), given 'torch_symm_mem'"),
        (["--hf-model", "deepseek-v3-fp8"],
         "--elastic: expected a model without FP8 experts (a recovery moves unquantized weights "
         "only), given --hf-model deepseek-v3-fp8"),
    ],
)  # fmt: skip
def test_bad_hf_elastic_arguments_are_one_line_exit_2(argv, line, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "_launch", lambda *args: pytest.fail("a run was started"))
    base = ["--launcher", "spawn", "--dp", "3", "--hf-model", "qwen3-moe", "--elastic"]
    assert main([*base, *argv]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert (captured.out + captured.err).splitlines() == [f"error: {line}"]


def test_the_hf_workload_forms_the_group_and_knows_its_dead() -> None:
    from ep_runtime.launch import hf_run

    argv = ["--hf-model", "qwen3-moe", "--dp", "3", "--elastic", "--kill-rank", "0@2"]
    workload = hf_run.build_spec(build_parser().parse_args(argv), 3).workload
    assert workload.forms_elastic_group and workload.kills == (KillAt(0, 2),)
    assert workload.killed_ranks == {0} and workload.reporting_rank == 1
    assert workload.to_json()["kills"] == ["0@2"]
    plain = hf_run.build_spec(build_parser().parse_args(argv[:4]), 3).workload
    assert not plain.forms_elastic_group and plain.killed_ranks == frozenset()
