"""What the launcher prints, as a newcomer sees it (issue 47 item 7): every preset's report fits
80 columns in a terminal and piped, nothing cut; the last line is the verdict, so it is on a
24-row screen when the run ends; progress bars (ours and transformers') only on a terminal; the
fp8 reference says in one line why transformers' fp8 forward did not run."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from ep_runtime.bench.report import build_report, ms_text, print_report, verdict_line
from ep_runtime.launch.presets import PRESETS, ModelPreset
from ep_runtime.launch.progress import HF_PROGRESS_BARS_OFF, RunProgress
from ep_runtime.launch.spec import Step
from tests.launch.test_launch_report import CHOICE, _hf_report, _table_rows
from tests.support.hf_oracle import needs_transformers
from tests.support.processes import ENV, LAUNCH, REPO

WIDTH = 80
LONG_HOST = "ip-10-213-0-12.cluster.internal"
# (world size, layouts, layer_graph, host, per-phase medians in ms): a slow CPU run, and a
# fast GPU run with both layouts and the CUDA-graph row
SCENARIOS = {
    "cpu": (2, ("expanded",), False, "vm", (95.861, 786.568, 45.526, 99876.7)),
    "gpu": (8, ("standard", "expanded"), True, LONG_HOST, (0.0123, 0.3456, 0.0211, 0.4012)),
}
PHASES = ("dispatch", "experts", "combine", "layer")
BAR_CHARACTERS = ("\r", "━", "█", "⠋", "Loading weights")


def _stats(ms: float) -> dict:
    return {"median_s": ms / 1e3, "min_s": ms / 2e3, "max_s": ms / 5e2, "iterations": 10}


def _rank_summary(model: ModelPreset, rank: int, scenario: str) -> dict:
    """What ``LayerRankWorker.summarize`` returns for ``model`` at its default tokens per rank,
    sized from the shape (fp32, every (token, expert) pair received: the most a rank gets)."""
    world, layouts, graph, host, medians = SCENARIOS[scenario]
    tokens, k, h, i = model.tokens_per_rank, model.top_k, model.hidden_size, model.intermediate_size
    experts = model.num_experts // world
    pairs = tokens * k
    weights = experts * 3 * h * i * 4
    times = dict(zip(PHASES, medians, strict=True)) | ({"layer_graph": medians[3]} if graph else {})
    case = {
        "dispatcher": "torch_a2a",
        "experts": "grouped_mm",
        "refused": {},
        "phases": {phase: _stats(ms) for phase, ms in times.items()},
        "validation": {"passed": True, "max_abs_err": 5.5e-7, "max_rel_err": 2.2e-7 * (rank + 1),
                       "tolerance": 2.21e-5, "validated_tokens": 64},
    }  # fmt: skip
    return {
        "rank": rank, "host": host, "pid": 100 + rank, "node_ip": None, "interfaces": {},
        "device": "cpu", "tokens": tokens, "dtype": "float32", "received_rows": pairs,
        "dispatch_received_bytes": pairs * h * 4, "combine_bytes": pairs * h * 4,
        "valid_pairs": pairs, "expert_flops": pairs * 6 * h * i,
        "local_experts": [rank * experts, (rank + 1) * experts],
        "local_expert_counts": [pairs // experts] * experts, "expert_imbalance": 3.17,
        "expert_weight_bytes": weights, "peak_memory_bytes": 3 * weights,
        "cases": [case | {"requested_layout": layout, "layout": layout,
                          "choice": CHOICE.format(layout=layout)} for layout in layouts],
        "global_expert_counts": [pairs * world // model.num_experts] * model.num_experts,
        "traffic_rows": [[tokens] * world] * world,
        "baselines": {name: _stats(ms) for name, ms in (("a2a_dispatch", medians[0] / 16),
                      ("a2a_combine", medians[2] / 19), ("dense_gemm", medians[1] * 0.69),
                      ("weights_read", medians[1] * 0.07))},
    }  # fmt: skip


def _preset_report(name: str, scenario: str) -> dict:
    model = PRESETS[name]
    spec = {"device": "cpu", "mode": "exact", "model": model.to_json()}
    world = SCENARIOS[scenario][0]
    return build_report(spec, "ray", [_rank_summary(model, r, scenario) for r in range(world)], 9.0)


def _terminal_text(report: dict) -> str:
    console = Console(width=WIDTH, record=True, force_terminal=True, color_system=None)
    print_report(report, console)
    return console.export_text()


def _piped_text(report: dict) -> str:
    """As ``cli.main`` prints to a pipe: a wider console, prose unwrapped."""
    stream = io.StringIO()
    console = Console(file=stream, width=100, soft_wrap=True, force_terminal=False)
    print_report(report, console)
    return stream.getvalue()


def _tables(text: str) -> list[list[str]]:
    """The lines of each table: from its title to the blank line after it."""
    tables, current = [], None
    for line in text.splitlines():
        if line.startswith(("Phases, ", "Validation, ", "Ranks: ")):
            current = []
            tables.append(current)
        if current is not None:
            if not line.strip():
                current = None
            else:
                current.append(line)
    return tables


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_presets_report_fits_80_columns_and_ends_with_the_verdict(preset, scenario):
    report = _preset_report(preset, scenario)
    world, layouts, graph, _, medians = SCENARIOS[scenario]
    terminal, piped = _terminal_text(report), _piped_text(report)
    assert max(len(line) for line in terminal.splitlines()) <= WIDTH, terminal
    tables = _tables(piped)
    assert len(tables) == 2 * len(layouts) + 1, piped
    for table in tables:
        assert max(len(line) for line in table) <= WIDTH, "\n".join(table)
    for text in (terminal, piped):
        assert "…" not in text  # no cell cut
        assert text.strip().splitlines()[-1] == verdict_line(report)
        for layout in layouts:  # every phase's median in full, in the row that names it
            rows = _table_rows(text, f"Phases, torch_a2a / grouped_mm, layout {layout}")
            shown = {row[0]: row[1] for row in rows}
            expected = dict(zip(PHASES, medians, strict=True))
            expected |= {"layer_graph": medians[3]} if graph else {}
            assert shown == {phase: ms_text(ms) for phase, ms in expected.items()}
        traffic = _table_rows(text, "Ranks: traffic and memory")
        weights = PRESETS[preset].num_experts // world * 3 * PRESETS[preset].hidden_size
        weights_mb = f"{weights * PRESETS[preset].intermediate_size * 4 / 1e6:.1f}"
        assert [row[-2] for row in traffic if row[0].isdigit()] == [weights_mb] * world


def test_the_verdict_names_the_outcome_the_layer_time_and_the_error():
    report = _preset_report("qwen3-30b-a3b", "cpu")
    assert (
        verdict_line(report) == "PASSED: layer 99877 ms per forward, rel err 4.4e-07 (tol 2.2e-05)"
    )
    both = _preset_report("deepseek-v3", "gpu")
    both["cases"][1]["passed"] = both["passed"] = False
    assert verdict_line(both) == (
        "FAILED: layer standard 0.401, expanded 0.401 ms, rel err 1.8e-06 (tol 2.2e-05)"
    )
    for case in both["cases"]:  # the longest below 100 s still fits
        case["phases"]["layer"]["median_ms"] = 99999.4
    assert len(verdict_line(both)) <= WIDTH
    assert [ms_text(ms) for ms in (0.0123, 9.9996, 95.861, 992.22, 12345.6)] == [
        "0.012", "10.00", "95.86", "992.2", "12346"
    ]  # fmt: skip


@pytest.mark.parametrize("mismatch_rank", [None, 1])
def test_hf_report_ends_with_its_verdict(mismatch_rank):
    from ep_runtime.launch.hf_report import print_hf_report

    console = Console(width=WIDTH, record=True, force_terminal=True, color_system=None)
    print_hf_report(_hf_report(mismatch_rank=mismatch_rank), console)
    last = console.export_text().strip().splitlines()[-1]
    if mismatch_rank is None:
        assert last == "PASSED: tokens as transformers', logits rel err 4.8e-07 (tol 4.3e-06)"
    else:
        assert last == "FAILED: tokens differ on rank 1, logits rel err 4.8e-07 (tol 4.3e-06)"


def test_hf_verdict_counts_the_ranks_whose_tokens_differ_where_many_do():
    from ep_runtime.launch.hf_report import hf_verdict_line

    report = _hf_report(world=8)
    for row in report["per_rank"][1:]:
        row["validation"]["tokens_match"] = False
    report["passed"] = False
    line = hf_verdict_line(report)
    assert line.startswith("FAILED: tokens differ on 7 of 8 ranks, logits rel err")
    report["per_rank"][1]["validation"]["tokens_match"] = True
    report["per_rank"][2]["validation"]["tokens_match"] = True
    report["per_rank"][3]["validation"]["tokens_match"] = True
    assert hf_verdict_line(report).startswith("FAILED: tokens differ on ranks 4, 5, 6, 7,")


def test_progress_is_drawn_on_a_terminal_only():
    steps = [Step("setup", (), 1, "weights and inputs"), Step("summarize", (), 0, "summarize")]
    drawn = {}
    for terminal in (True, False):
        stream = io.StringIO()
        console = Console(file=stream, width=WIDTH, force_terminal=terminal, color_system=None)
        with RunProgress(console, steps) as progress:
            progress.status("starting")
            for step in steps:
                progress.done(step)
        drawn[terminal] = stream.getvalue()
    assert "1/1" in drawn[True] and "━" in drawn[True]
    assert drawn[False] == ""


@needs_transformers
def test_a_piped_checkpoint_run_reads_shards_shows_no_progress_bar_ends_with_the_verdict(
    tmp_path: Path,
):
    """A checkpoint directory, so that the reporting process loads it with transformers'
    ``from_pretrained`` (its "Loading weights" bar), on spawn ranks; stdout and stderr piped.
    The same run is the launcher's sharded load of a checkpoint directory: each rank reads the
    dense part (DeepSeek-V2's shared experts included) and half the routed experts, and prints
    what it read."""
    from ep_runtime.integrations.transformers import build_random_model, random_config
    from tests.support.checkpoint_files import write_checkpoint

    model = build_random_model(random_config("deepseek-v2"), seed=0)
    checkpoint = write_checkpoint(model, tmp_path / "ckpt")
    env = {k: v for k, v in ENV.items() if k != HF_PROGRESS_BARS_OFF}
    argv = ["--launcher", "spawn", "--dp", "2", "--device", "cpu", "--hf-model", str(checkpoint)]
    report = tmp_path / "report.json"
    run = subprocess.run(
        [*LAUNCH, *argv, "--hf-new-tokens", "3", "--json", str(report)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    for character in BAR_CHARACTERS:
        assert character not in output, (character, output)
    assert run.stdout.strip().splitlines()[-1].startswith("PASSED: tokens as transformers'")
    total = sum(p.numel() * 4 for p in model.parameters())
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    for rank, row in enumerate(json.loads(report.read_text())["per_rank"]):
        assert row["bytes_read"] == total - experts // 2, f"rank {rank}"  # dense + half the experts
        assert row["load_s"] > 0 and f"rank {rank}/2: read " in row["load"]
        assert " ".join(row["load"].split()) in " ".join(run.stdout.split())  # printed (wrapped)


@needs_transformers
def test_the_fp8_reference_off_a_gpu_says_why_in_one_line(monkeypatch):
    """Issue 47 item 7.4: on a CPU, transformers' fp8 forward is not tried (its Hub kernel's
    trust error was quoted before): the reason is that it needs a GPU."""
    from ep_runtime.integrations.transformers import build_random_model, random_config
    from ep_runtime.integrations.transformers import fp8 as hf_fp8
    from ep_runtime.launch.hf_report import fp8_reference

    def not_tried(model):
        raise AssertionError("transformers' fp8 forward was tried on a CPU")

    monkeypatch.setattr(hf_fp8, "fp8_forward_unavailable", not_tried)
    model = build_random_model(random_config("deepseek-v3-fp8"), seed=0)
    reference = fp8_reference(model)
    assert reference is not None and "\n" not in reference
    assert reference.endswith(
        "transformers' fp8 forward does not run here (it needs a GPU, its kernels are CUDA "
        "only; the reference runs on cpu)"
    )
    assert "trust_remote_code" not in reference
    assert fp8_reference(build_random_model(random_config("qwen3-moe"), seed=0)) is None
