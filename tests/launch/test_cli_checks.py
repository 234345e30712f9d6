"""What a user meets before any rank starts: argparse's own errors as one line like the
launcher's checks, the memory pre-check (its line, and its estimate against a measured peak),
and docs/launch.md's options tables equal to the parser's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ep_runtime.launch import cli, memory, options_doc
from ep_runtime.launch.cli import EXIT_USAGE, main
from ep_runtime.launch.presets import PRESETS
from tests.support.processes import ENV, LAUNCH, REPO


def _no_launch(*args):
    raise AssertionError("a run was started")


# item 3: every invalid choice or type is one line ------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--layout", "sideways"],
         "error: --layout: expected one of auto, standard, expanded, both, given 'sideways'"),
        (["--mode", "fast"], "error: --mode: expected one of exact, capacity, given 'fast'"),
        (["--dtype", "fp8"], "error: --dtype: expected one of auto, bf16, fp32, given 'fp8'"),
        (["--device", "tpu"], "error: --device: expected one of auto, cpu, cuda, given 'tpu'"),
        (["--launcher", "slurm"],
         "error: --launcher: expected one of auto, ray, spawn, torchrun, given 'slurm'"),
        (["--activation", "gelu"],
         "error: --activation: expected one of silu, relu2, given 'gelu'"),
        (["--dp", "two"], "error: --dp: expected an integer, given 'two'"),
        (["--timeout", "soon"], "error: --timeout: expected a number, given 'soon'"),
        (["--inject-failure", "1:explode"],
         "error: --inject-failure: expected RANK:raise|input|exit|kill|hang[:ITER], given "
         "'1:explode'"),
        (["--dp"], "error: --dp: expected one argument"),
        (["--sideways"],
         "error: unrecognized arguments: --sideways (see python -m ep_runtime.launch --help)"),
    ],
)  # fmt: skip
def test_argparse_errors_are_one_line_exit_2(argv, line, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_launch", _no_launch)
    with pytest.raises(SystemExit) as exited:
        main(["--launcher", "spawn", *argv])
    assert exited.value.code == EXIT_USAGE
    captured = capsys.readouterr()
    assert (captured.out + captured.err).splitlines() == [line]


def test_an_invalid_choice_from_the_command_line_is_one_line():
    """As a user types it: no usage block before the line."""
    done = subprocess.run(
        [*LAUNCH, "--layout", "sideways"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_USAGE
    output = (done.stdout + done.stderr).strip()
    assert output.splitlines() == [
        "error: --layout: expected one of auto, standard, expanded, both, given 'sideways'"
    ], output


# item 2: the memory pre-check ---------------------------------------------------------------------
def test_too_many_tokens_is_refused_before_any_rank_starts(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_launch", _no_launch)
    assert main(["--launcher", "spawn", "--tokens", "100000000"]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    estimate = memory.layer_estimate(
        PRESETS["tiny"].with_overrides(tokens_per_rank=100_000_000), 2, torch.float32, "exact"
    )
    available, where = memory.available_bytes("cpu")
    assert 2 * estimate.total > available  # the premise: this machine cannot hold it
    assert out.startswith("error: --tokens: expected at most "), out
    assert "given 100000000: 2 ranks need about 2 × " in out
    assert f"{memory._bytes(estimate.total)} (weights " in out and where in out


def test_a_model_too_large_for_the_host_names_the_model(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_launch", _no_launch)
    monkeypatch.setattr(memory, "available_bytes", lambda device: (10**9, "available here"))
    args = ["--launcher", "spawn", "--model", "deepseek-v3", "--dp", "1", "--device", "cpu"]
    assert main(args) == EXIT_USAGE  # CPU ranks: fp32 weights, on any host
    out = capsys.readouterr().out
    assert out.startswith("error: --model: expected a model whose expert shard fits in memory, "
                          "given deepseek-v3"), out  # fmt: skip
    assert "(weights 45.1 GB," in out and "1 GB available here" in out


def test_weights_in_the_estimate_are_the_shard_the_rank_builds():
    """Weights by hand: DeepSeek-V3 at EP8 holds 32 experts of (2·2048 + 2048)·7168 bf16."""
    estimate = memory.layer_estimate(PRESETS["deepseek-v3"], 8, torch.bfloat16, "exact")
    assert estimate.weights == 32 * (2 * 2048 + 2048) * 7168 * 2


# run in a fresh process: its peak resident set during the layer's steps (the kernel's high-water
# mark reset first, so imports' own peak does not hide it), less its resident set before them
MEASURE = """
import json, torch, torch.distributed as dist
from ep_runtime.launch.layer_run import LayerWorkload
from ep_runtime.launch.presets import PRESETS
from ep_runtime.launch.rank import RankWorker
from ep_runtime.launch.spec import RunSpec
torch.set_num_threads(1)
model = PRESETS["tiny"].with_overrides(tokens_per_rank=TOKENS)
spec = RunSpec(1, "cpu", LayerWorkload(model=model, dtype="fp32", iters=1, warmup=0,
                                       baselines=False, layouts=("LAYOUT",)))
worker = RankWorker(spec, 0)
worker.init_process_group(store=dist.HashStore())
from tests.support.resident_memory import peak_rss_bytes, reset_peak_rss, rss_bytes
reset_peak_rss()
before = rss_bytes()
for step in ("setup", "build"):
    worker.step(step, (0,) if step == "build" else ())
worker.step("run_iters", (1, True))
peak = peak_rss_bytes()
worker.shutdown()
print(json.dumps(peak - before))
"""


@pytest.mark.parametrize("layout", ["standard", "expanded"])
def test_memory_estimate_is_the_measured_peak_within_a_factor_of_two(layout):
    """The estimate against a real forward's peak resident set (tiny, 20k tokens, world 1)."""
    tokens = 20_000
    code = MEASURE.replace("TOKENS", str(tokens)).replace("LAYOUT", layout)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    model = PRESETS["tiny"].with_overrides(tokens_per_rank=tokens)
    estimate = memory.layer_estimate(model, 1, torch.float32, "exact").total
    assert estimate / 2 <= measured <= estimate * 2, (measured, estimate)


# item 8: the manual's options tables are the parser's ---------------------------------------------
def test_the_manuals_options_tables_are_generated_from_the_parser():
    documented = options_doc.documented(options_doc.DOC.read_text())
    assert documented == options_doc.options_markdown(), (
        "docs/launch.md's options differ from the parser: "
        "run python -m ep_runtime.launch.options_doc --write"
    )
    for option in ("--hf-model", "--hf-prompt-tokens", "--hf-new-tokens", "--hf-idle-rank"):
        assert f"`{option} " in documented


def test_every_option_of_the_parser_has_a_row():
    rows = options_doc.options_markdown()
    for action in cli.build_parser()._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            assert f"`{', '.join(action.option_strings)}" in rows, action.option_strings


# item 10: the README's report files do not show up as untracked --------------------------------
def test_reports_written_in_the_clones_root_are_ignored_by_git():
    done = subprocess.run(
        ["git", "check-ignore", "out.json", "out.png", "ep16.json", "out/report.json"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode == 128:
        pytest.skip("not a git checkout")
    assert done.stdout.split() == ["out.json", "out.png", "ep16.json", "out/report.json"]
