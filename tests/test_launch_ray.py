"""The Ray launcher end to end, as users run it (``python -m ep_runtime.launch`` in a subprocess):
a passing run with JSON and plot, a rank that raises, a rank actor killed from outside, Ctrl-C,
and ``ray start`` + ``ray job submit``. After each, no process the run started may be left."""

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

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed"
)

REPO = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "ep_runtime.launch"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")} | {
    "RAY_USAGE_STATS_ENABLED": "0"
}
FAILURE_BUDGET_S = 10.0  # a failed rank must end the run within this


# process bookkeeping ----------------------------------------------------------------------------
def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) for every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), fields[0], cmdline.decode(errors="replace"))
    return table


def _descendants(root: int) -> dict[int, str]:
    table = _process_table()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, cmd) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = cmd
                frontier.append(pid)
    return found


def _alive(pids) -> dict[int, str]:
    """Those of ``pids`` still running (zombies are dead: their parent just has not reaped them)."""
    table = _process_table()
    return {pid: table[pid][2] for pid in pids if pid in table and table[pid][1] != "Z"}


class Run:
    """A CLI run in a subprocess, remembering every process it started."""

    def __init__(self, *args: str, cwd: Path = REPO) -> None:
        self.process = subprocess.Popen(
            [*LAUNCH, *args],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.seen: dict[int, str] = {}

    def watch_until(self, predicate, timeout: float) -> bool:
        """Poll the process tree until ``predicate(tree)`` or the run ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            tree = _descendants(self.process.pid)
            for pid, cmd in tree.items():  # an exiting process (zombie) shows an empty cmdline:
                if cmd.strip() or pid not in self.seen:  # keep the command it ran under
                    self.seen[pid] = cmd
            if predicate(tree):
                return True
            time.sleep(0.1)
        return False

    def rank_actors(self) -> list[int]:
        return [
            pid for pid, cmd in _descendants(self.process.pid).items() if "ray::RankActor" in cmd
        ]

    def finish(self, timeout: float) -> tuple[int, str]:
        self.watch_until(lambda tree: False, timeout)
        output = self.process.communicate(timeout=timeout)[0]
        return self.process.returncode, output

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 5  # ray.shutdown's SIGTERM/SIGKILL may take a moment
        while _alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(self.seen), f"left behind: {_alive(self.seen)}"


def _running_ranks(count: int):
    def predicate(tree: dict[int, str]) -> bool:
        return sum("ray::RankActor.step" in cmd for cmd in tree.values()) >= count

    return predicate


# runs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dp", "extra"),
    [(2, ()), pytest.param(4, ("--layout", "both"), marks=pytest.mark.slow)],
)
def test_ray_run_passes_and_reports(tmp_path, dp, extra):
    report, plot = tmp_path / "report.json", tmp_path / "plot.png"
    started = time.monotonic()
    run = Run("--dp", str(dp), "--json", str(report), "--plot", str(plot), *extra)
    code, output = run.finish(timeout=120)
    elapsed = time.monotonic() - started
    assert code == 0, output
    assert elapsed < 60, f"took {elapsed:.1f} s"
    assert "Ranks" in output and "PASSED" in output
    data = json.loads(report.read_text())
    assert data["passed"] and data["launcher"] == "ray" and data["world_size"] == dp
    assert data["max_rel_err"] <= data["tolerance"]
    assert [r["rank"] for r in data["per_rank"]] == list(range(dp))
    assert len({r["pid"] for r in data["per_rank"]}) == dp  # one actor process per rank
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert any("raylet" in cmd for cmd in run.seen.values())  # it did start a local cluster
    run.assert_nothing_left()


def test_rank_that_raises_ends_the_run_naming_it(tmp_path):
    run = Run("--dp", "2", "--inject-failure", "1:raise:1", "--json", str(tmp_path / "r.json"))
    code, output = run.finish(timeout=120)
    ended = time.time()
    assert code == 3, output
    assert "rank 1 (raised" in output and "injected failure on rank 1" in output
    failed_at = float(re.search(r"at unix time ([0-9.]+)", output).group(1))
    assert ended - failed_at < FAILURE_BUDGET_S, f"{ended - failed_at:.1f} s"
    assert json.loads((tmp_path / "r.json").read_text())["failed_rank"] == 1
    run.assert_nothing_left()


def test_killed_rank_actor_ends_the_run_naming_it():
    run = Run("--dp", "2", "--iters", "1000000")  # long enough to be killed mid-run
    assert run.watch_until(_running_ranks(2), timeout=90), "rank actors never started"
    time.sleep(1.0)  # well inside the timed loop
    victim = max(run.rank_actors())
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    code, output = run.finish(timeout=60)
    assert time.monotonic() - killed_at < FAILURE_BUDGET_S
    assert code == 3, output
    named = re.search(r"rank (\d) \(died", output)
    assert named is not None, output
    assert f"pid: {victim}" in output  # the named rank is the killed process
    run.assert_nothing_left()


def test_ctrl_c_tears_everything_down():
    run = Run("--dp", "2", "--iters", "1000000")
    assert run.watch_until(_running_ranks(2), timeout=90), "rank actors never started"
    run.process.send_signal(signal.SIGINT)
    interrupted_at = time.monotonic()
    code, output = run.finish(timeout=60)
    assert time.monotonic() - interrupted_at < FAILURE_BUDGET_S
    assert code == 130, output
    assert "interrupted" in output
    run.assert_nothing_left()


# ray start + ray job submit ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_cluster(markers: list[str]) -> None:
    """Stop only this test's cluster (``ray stop`` would stop every Ray on the machine)."""
    table = _process_table()
    doomed = {pid for pid, (_, _, cmd) in table.items() if any(m in cmd for m in markers)}
    for pid in list(doomed):
        doomed |= set(_descendants(pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _alive(doomed):
            os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while _alive(doomed) and time.monotonic() < deadline:
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
