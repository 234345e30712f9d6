"""Whole launcher runs without Ray: the spawn launcher and torchrun validating every rank, a
rank's failure or bad input ending the run with its name, the negative control (a wrong layer
caught), a killed launcher leaving no rank behind, the launcher's extra named when missing.
Ctrl-C to a spawn run's process group is checked at the end of the run whose listeners
tests/launch/test_listeners.py samples."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ep_runtime.bench.metrics import destination_rows, expert_token_counts
from ep_runtime.launch import layer_data
from ep_runtime.launch.cli import EXIT_OK, EXIT_RANK_FAILED, EXIT_USAGE, main
from ep_runtime.launch.layer_run import LayerWorkload
from ep_runtime.launch.presets import PRESETS
from ep_runtime.launch.rank import RankWorker
from ep_runtime.launch.spec import RunSpec
from tests.support.processes import alive, cpu_seconds, descendants

CPU = torch.device("cpu")
TINY = PRESETS["tiny"]
TINY_CONFIG = TINY.moe_config()
REPO = Path(__file__).resolve().parents[2]


def _run_spawn(tmp_path: Path, *extra: str) -> tuple[int, dict, float]:
    report = tmp_path / "report.json"
    started = time.monotonic()
    code = main(
        ["--launcher", "spawn", "--iters", "2", "--warmup", "1", "--json", str(report), *extra]
    )
    return code, json.loads(report.read_text()), time.monotonic() - started


def test_spawn_run_validates_every_rank_and_reports_hand_countable_facts(tmp_path, capsys):
    plot = tmp_path / "plot.png"
    code, report, _ = _run_spawn(tmp_path, "--dp", "4", "--layout", "both", "--plot", str(plot))
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "Ranks" in out and "PASSED" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["passed"] and report["world_size"] == 4 and report["launcher"] == "spawn"
    assert [case["layout"] for case in report["cases"]] == ["standard", "expanded"]
    for key in ("dispatcher", "experts", "layout", "max_abs_err", "phases", "per_rank"):
        assert key in report
    assert set(report["phases"]) == {"dispatch", "experts", "combine", "layer"}
    assert report["max_rel_err"] <= report["tolerance"]
    # counts and traffic recomputed here from the same seed
    model, world = TINY, 4
    routes = [layer_data.rank_routing(model, r, model.tokens_per_rank, 0, CPU)[0] for r in range(4)]
    counts = [sum(c) for c in zip(*(expert_token_counts(i, 16) for i in routes), strict=True)]
    assert report["load"]["global_expert_counts"] == counts
    traffic = [destination_rows(i, 16, world) for i in routes]
    for rank, entry in enumerate(report["per_rank"]):
        assert entry["rank"] == rank and entry["passed"]
        assert entry["received_rows"] == sum(row[rank] for row in traffic)
        assert entry["local_expert_counts"] == counts[rank * 4 : rank * 4 + 4]
        assert entry["expert_weight_bytes"] == layer_data.shard_weight_bytes(
            TINY_CONFIG, 4, torch.float32
        )
        assert all(v["deterministic"] and v["validated_tokens"] == 64 for v in entry["validation"])


@pytest.mark.parametrize("kind", ["raise", "exit", "hang"])
def test_spawn_failure_ends_run_naming_the_rank(tmp_path, capsys, kind):
    """A hung rank is found through the collective timeout (3 s here) of its peer."""
    code, report, elapsed = _run_spawn(
        tmp_path, "--dp", "2", "--timeout", "3", "--inject-failure", f"1:{kind}:1"
    )
    out = capsys.readouterr().out
    assert code == EXIT_RANK_FAILED, out
    assert elapsed < 30, f"{elapsed:.1f} s"
    assert report["failed_rank"] == 1 and not report["passed"]
    assert re.search(r"rank 1 \((raised|died|hung)", out)
    if kind == "raise":
        failed_at = float(re.search(r"at unix time ([0-9.]+)", out).group(1))
        assert time.time() - failed_at < 10


def test_spawn_rank_rejecting_its_input_is_one_line_exit_2(tmp_path, capsys):
    code, report, _ = _run_spawn(tmp_path, "--dp", "2", "--inject-failure", "1:input:0")
    out = capsys.readouterr().out
    assert code == EXIT_USAGE, out
    line = (
        "error: rank 1 raised during the run: EPInputError: topk_ids: expected ids in [-1, 16), "
        "given id 16 (injected on rank 1)"
    )
    assert [text for text in out.splitlines() if "rank 1" in text] == [line]
    assert "Traceback" not in out
    assert report["failed_rank"] == 1 and report["usage_error"].startswith("EPInputError")


def test_torchrun_runs_the_same_rank_code(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "ep_runtime.launch"]
    command += ["--device", "cpu", "--iters", "2", "--warmup", "1", "--json", str(report)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(report.read_text())
    assert data["passed"] and data["launcher"] == "torchrun" and data["world_size"] == 2
    assert result.stdout.count("Ranks") == 1  # only rank 0 reports


def test_rank_validation_fails_a_layer_that_applies_weights_twice():
    """Negative control: the launcher's check must catch a wrong output (here 2× the truth)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    workload = LayerWorkload(
        model=TINY.with_overrides(tokens_per_rank=16),
        dtype="fp32",
        iters=1,
        warmup=0,
        baselines=False,
    )
    spec = RunSpec(world_size=1, device="cpu", workload=workload)
    threads = torch.get_num_threads()
    worker = RankWorker(spec, 0)
    worker.init_process_group(store=dist.HashStore())
    try:
        worker.step("setup", ())
        worker.step("build", (0,))
        assert worker.step("validate", ())["passed"]
        layer = worker.workload.layer
        forward = layer.experts.forward
        layer.experts.forward = lambda dispatched, out=None: forward(dispatched) * 2
        result = worker.step("validate", ())
        assert not result["passed"] and result["max_rel_err"] > 0.5
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)


# spawn launcher: signals ------------------------------------------------------------------------
def _spawn_ranks(run) -> list[int]:
    """The launcher's rank processes (multiprocessing spawn children; not its resource tracker)."""
    tree = descendants(run.process.pid)
    return [pid for pid, cmd in tree.items() if "spawn_main" in cmd]


def _ranks_busy(run, count: int, cpu_s: float = 3.0):
    """Predicate: ``count`` ranks exist and each has used ``cpu_s`` of CPU (torch imported and
    the process group up: it is in its timed loop by then)."""

    def predicate(tree: dict[int, str]) -> bool:
        ranks = [pid for pid, cmd in tree.items() if "spawn_main" in cmd]
        return len(ranks) >= count and all(cpu_seconds(pid) >= cpu_s for pid in ranks)

    return predicate


def test_spawn_launcher_killed_leaves_no_rank_behind(launcher_runs):
    """SIGKILL gives the launcher no chance to clean up: the ranks must go by themselves."""
    run = launcher_runs("--launcher", "spawn", "--dp", "2", "--iters", "1000000")
    assert run.watch_until(_ranks_busy(run, 2), timeout=120), "ranks never got going"
    ranks = _spawn_ranks(run)
    run.process.kill()
    run.process.wait(10)
    deadline = time.monotonic() + 10
    while alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(ranks) == 2 and not alive(ranks), f"ranks alive 10 s later: {alive(ranks)}"
    run.assert_nothing_left()


# the launcher's own packages -------------------------------------------------------------------
HIDE = "import sys; sys.modules.update({name: None for name in sys.argv[1:]}); "  # import fails


@pytest.mark.parametrize(
    ("hidden", "argv", "message"),
    [
        (
            ["rich"],
            [],
            "needs rich (the 'launch' extra, with ray): pip install 'ep_runtime[launch]'",
        ),
        (["ray"], ["--launcher", "ray"], "--launcher ray: expected ray to be installed"),
    ],
    ids=["no_rich", "no_ray"],
)
def test_launcher_without_its_extra_names_it_in_one_line(hidden, argv, message):
    """``python -m ep_runtime.launch`` where rich (or, for --launcher ray, ray) cannot be
    imported: exit 2 and one line naming the 'launch' extra, before any rank starts."""
    code = HIDE + (
        "import runpy; sys.argv = ['ep_runtime.launch', *" + repr(argv) + "]; "
        "runpy.run_module('ep_runtime.launch', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *hidden], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == EXIT_USAGE, output
    assert message in output and "pip install 'ep_runtime[launch]'" in output, output
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
