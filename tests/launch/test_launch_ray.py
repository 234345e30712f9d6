"""The Ray launcher end to end, as users run it (``python -m ep_runtime.launch`` in a subprocess):
a passing run with JSON and plot, a rank that raises, a rank actor killed from outside, a run
stopped by SIGTERM, and ``ray start`` + ``ray job submit``. After each, no process the run started
may be left. Ctrl-C to the launcher ends the run whose listeners tests/launch/test_listeners.py
samples, and is checked there (exit 130, nothing left, no temp dir)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ep_runtime.bench.report import CONVENTIONS
from tests.support.processes import (
    ENV,
    REPO,
    Run,
    alive,
    descendants,
    process_table,
    ray_temp_dirs,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed"
)

FAILURE_BUDGET_S = 10.0  # a failed rank must end the run within this


def _rank_actors(run: Run) -> list[int]:
    return [pid for pid, cmd in descendants(run.process.pid).items() if "ray::RankActor" in cmd]


def _running_ranks(count: int):
    def predicate(tree: dict[int, str]) -> bool:
        return sum("ray::RankActor.step" in cmd for cmd in tree.values()) >= count

    return predicate


def test_driver_forwards_settings_but_not_a_nodes_network(monkeypatch):
    """The driver's interface variables describe its own node: they must not override what
    another node set (issue 15); its other NCCL/gloo settings still reach every rank."""
    from ep_runtime.launch.ray_driver import propagated_env

    for key, value in {
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_SOCKET_IFNAME": "=eth0",
        "TP_SOCKET_IFNAME": "eth0",
        "NCCL_IB_HCA": "mlx5_0",
        "NCCL_DEBUG": "INFO",
        "EP_RUNTIME_X": "1",
        "CUDA_VISIBLE_DEVICES": "0",
    }.items():
        monkeypatch.setenv(key, value)
    forwarded = propagated_env()
    assert forwarded["NCCL_DEBUG"] == "INFO" and forwarded["EP_RUNTIME_X"] == "1"
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA",
                "CUDA_VISIBLE_DEVICES"):  # fmt: skip
        assert key not in forwarded


# runs -------------------------------------------------------------------------------------------
def test_ray_run_passes_and_reports(tmp_path, launcher_runs):
    """A passing local Ray run (Ray's defaults: token authentication on): the report, the JSON
    and the plot; no warning printed, and each legend line whole (piped, not wrapped)."""
    dp = 2
    report, plot = tmp_path / "report.json", tmp_path / "plot.png"
    started = time.monotonic()
    run = launcher_runs("--dp", str(dp), "--json", str(report), "--plot", str(plot))
    code, output = run.finish(timeout=120)
    elapsed = time.monotonic() - started
    assert code == 0, output
    assert elapsed < 60, f"took {elapsed:.1f} s"
    assert "Ranks" in output and "PASSED" in output
    assert not re.search(r"warn", output, re.IGNORECASE), output
    lines = output.splitlines()
    for convention in CONVENTIONS:
        assert convention in lines, convention
    data = json.loads(report.read_text())
    assert data["passed"] and data["launcher"] == "ray" and data["world_size"] == dp
    assert data["max_rel_err"] <= data["tolerance"]
    assert [r["rank"] for r in data["per_rank"]] == list(range(dp))
    assert len({r["pid"] for r in data["per_rank"]}) == dp  # one actor process per rank
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert any("raylet" in cmd for cmd in run.seen.values())  # it did start a local cluster
    run.assert_nothing_left()
    assert ray_temp_dirs(run.process.pid) == []  # the cluster's temp dir went with it


def test_rank_that_raises_ends_the_run_naming_it(tmp_path, launcher_runs):
    run = launcher_runs(
        "--dp", "2", "--inject-failure", "1:raise:1", "--json", str(tmp_path / "r.json")
    )
    code, output = run.finish(timeout=120)
    ended = time.time()
    assert code == 3, output
    assert "rank 1 (raised" in output and "injected failure on rank 1" in output
    failed_at = float(re.search(r"at unix time ([0-9.]+)", output).group(1))
    assert ended - failed_at < FAILURE_BUDGET_S, f"{ended - failed_at:.1f} s"
    assert json.loads((tmp_path / "r.json").read_text())["failed_rank"] == 1
    run.assert_nothing_left()


def test_killed_rank_actor_ends_the_run_naming_it(launcher_runs):
    run = launcher_runs("--dp", "2", "--iters", "1000000")  # long enough to be killed mid-run
    assert run.watch_until(_running_ranks(2), timeout=90), "rank actors never started"
    time.sleep(1.0)  # well inside the timed loop
    victim = max(_rank_actors(run))
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    code, output = run.finish(timeout=60)
    assert time.monotonic() - killed_at < FAILURE_BUDGET_S
    assert code == 3, output
    named = re.search(r"rank (\d) \(died", output)
    assert named is not None, output
    assert f"pid: {victim}" in output  # the named rank is the killed process
    run.assert_nothing_left()


def test_a_run_stopped_at_teardown_leaves_no_ray_temp_dir(launcher_runs):
    """A test's teardown of a run still going (``Run.close``) stops the launcher first
    (``Run.stop``: SIGTERM to it alone): it tears down its ranks and its private cluster, temp
    dir included. (Before, the teardown signalled every process of the run at once and killed
    the launcher 2 s later, mid-teardown: an /tmp/epray_* dir stayed behind.)"""
    run = launcher_runs("--dp", "2", "--iters", "1000000")
    assert run.watch_until(_running_ranks(2), timeout=90), "rank actors never started"
    [temp_dir] = ray_temp_dirs(run.process.pid)
    run.stop()
    assert run.process.returncode == 130  # its own teardown, not a kill
    run.assert_nothing_left()
    assert not temp_dir.exists()


def test_rank_rejecting_its_input_is_one_line_exit_2(tmp_path, launcher_runs):
    """A rank's ``EPInputError`` reaches the driver intact (it pickles): one line naming the rank
    and the argument, exit 2, no traceback, no ``UnserializableException``."""
    report = tmp_path / "r.json"
    run = launcher_runs("--dp", "2", "--inject-failure", "1:input:0", "--json", str(report))
    code, output = run.finish(timeout=120)
    assert code == 2, output
    expected = (
        "error: rank 1 raised during step timed (auto): EPInputError: topk_ids: "
        "expected ids in [-1, 16), given id 16 (injected on rank 1)"
    )
    assert [line for line in output.splitlines() if "rank 1" in line] == [expected], output
    for noise in ("UnserializableException", "Traceback", 'File "', "Unhandled error"):
        assert noise not in output, output
    data = json.loads(report.read_text())
    assert data["failed_rank"] == 1 and data["usage_error"].startswith("EPInputError: topk_ids")
    run.assert_nothing_left()


def _private_pid_namespace() -> tuple[str, ...] | None:
    """A command prefix that runs a process where no other process is visible (so Ray's
    ``auto`` cannot find another user's cluster), or ``None`` where that cannot be made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    prefix = (unshare, *user, "--pid", "--fork", "--mount-proc")
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else None


def test_address_auto_without_a_cluster_exits_2_before_starting(launcher_runs):
    prefix = _private_pid_namespace()
    if prefix is None:
        running = [pid for pid, (_, _, cmd) in process_table().items() if "gcs_server" in cmd]
        if running:
            pytest.skip(f"ray is running here (gcs_server pids {running}) and unshare is refused")
        prefix = ()
    started = time.monotonic()
    run = launcher_runs("--dp", "2", "--address", "auto", prefix=prefix)
    code, output = run.finish(timeout=60)
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("cannot start: --address auto: expected a running Ray cluster")
    assert time.monotonic() - started < 30
    assert not any("raylet" in cmd or "gcs_server" in cmd for cmd in run.seen.values())


def _no_launch(*args):
    raise AssertionError("the launcher went on to start its ranks (and Ray)")


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_exits_2_before_ray_starts(tmp_path, option, monkeypatch, capsys):
    """In process (the CLI's ``main``; no subprocess needed): ``_launch``, which starts Ray and
    the ranks, fails the test if it is reached."""
    from ep_runtime.launch import cli

    monkeypatch.setattr(cli, "_launch", _no_launch)
    unwritable = tmp_path / "missing-dir" / "out.file"
    assert cli.main(["--dp", "2", option, str(unwritable)]) == cli.EXIT_USAGE
    output = capsys.readouterr()
    assert (output.out + output.err).strip().splitlines() == [
        f"error: {option}: expected a writable file, given '{unwritable}' "
        "(No such file or directory)"
    ]


# ray start + ray job submit ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_cluster(markers: list[str]) -> None:
    """Stop only this test's cluster (``ray stop`` would stop every Ray on the machine)."""
    table = process_table()
    doomed = {pid for pid, (_, _, cmd) in table.items() if any(m in cmd for m in markers)}
    for pid in list(doomed):
        doomed |= set(descendants(pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive(doomed):
            os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while alive(doomed) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.mark.skipif(
    importlib.util.find_spec("aiohttp") is None, reason="ray job submit needs ray[default]"
)
def test_ray_job_submit_runs_the_launcher():
    """``ray start --head``, then ``launch/submit.sh`` (``ray job submit``, runtime_env.yaml)."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    temp_dir = tempfile.mkdtemp(prefix="epjob_", dir="/tmp")
    gcs, dashboard, client, agent = (_free_port() for _ in range(4))
    env = ENV | {
        "RAY_AUTH_MODE": "token",  # token auth is on by default for local clusters (Ray >= 2.59)
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # job's python
    }
    start = [
        ray_cli, "start", "--head", "--num-cpus", "2", "--port", str(gcs),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
        "--temp-dir", temp_dir, "--disable-usage-stats",
    ]  # fmt: skip
    try:
        started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        submit = [str(REPO / "launch" / "submit.sh"), "--dp", "2", "--iters", "3"]
        job_env = env | {"RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}
        job = subprocess.run(submit, env=job_env, capture_output=True, text=True, timeout=240)
        output = job.stdout + job.stderr
        assert job.returncode == 0, output
        assert "PASSED" in output and "W=2 (ray" in output and "succeeded" in output
    finally:
        _stop_cluster([temp_dir, f":{gcs}", f"--port={client}"])
        shutil.rmtree(temp_dir, ignore_errors=True)
