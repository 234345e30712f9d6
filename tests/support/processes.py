"""Process bookkeeping for tests that run the launcher in a subprocess: the process tree it
starts, which of those processes are still alive, and a teardown that kills only them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# a private Ray cluster's temp dir (ep_runtime/launch/ray_driver.py): RAY_TEMP/epray_*, its
# session dir named after the launcher's pid
RAY_TEMP, RAY_TEMP_PREFIX = Path("/tmp"), "epray_"
STOP_GRACE_S = 20.0  # for a stopped launcher to end its ranks and its cluster
CLOSE_GRACE_S = 5.0  # the same at a test's teardown (what is left then is killed and removed)
LAUNCH = [sys.executable, "-m", "ep_runtime.launch"]
# the worktree's package in every process the launcher starts; no cluster from the environment
ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")} | {
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
}


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, ``None`` once it is gone. Plain reads of /proc: the
    tests poll a run's process tree ten times a second while it runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0].decode()


def command_line(pid: int) -> str:
    """The process's command line (empty for a zombie or a process gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) for every live process."""
    table = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None:
            table[pid] = (*stat, command_line(pid))
    return table


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process below ``root`` (command lines read for those
    only)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        for pid in children.get(frontier.pop(), ()):
            if pid not in found:
                found[pid] = command_line(pid)
                frontier.append(pid)
    return found


def alive(pids: Iterable[int]) -> dict[int, str]:
    """Those of ``pids`` still running (zombies are dead: their parent just has not reaped them)."""
    found = {}
    for pid in pids:
        stat = _stat(pid)
        if stat is not None and stat[1] != "Z":
            found[pid] = command_line(pid)
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_all(pids: Iterable[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace_s``; only the given processes."""
    pids = set(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)


def ray_temp_dirs(launcher_pid: int) -> list[Path]:
    """The temp dirs of the private Ray clusters a launcher process started that are still
    there (Ray names each session dir after the driver's pid)."""
    sessions = RAY_TEMP.glob(f"{RAY_TEMP_PREFIX}*/session_*_{launcher_pid}")
    return sorted({session.parent for session in sessions})


class Run:
    """A CLI run in a subprocess (its own process group), remembering every process it started.

    ``prefix`` wraps the command (e.g. ``unshare …``). ``close`` kills whatever is left of it."""

    def __init__(self, *args: str, cwd: Path = REPO, prefix: tuple[str, ...] = ()) -> None:
        self.process = subprocess.Popen(
            [*prefix, *LAUNCH, *args],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # like a terminal's foreground job: a group of its own
        )
        self.seen: dict[int, str] = {}

    def watch_until(self, predicate: Callable[[dict[int, str]], bool], timeout: float) -> bool:
        """Poll the process tree until ``predicate(tree)`` or the run ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            tree = descendants(self.process.pid)
            for pid, cmd in tree.items():  # an exiting process (zombie) shows an empty cmdline:
                if cmd.strip() or pid not in self.seen:  # keep the command it ran under
                    self.seen[pid] = cmd
            if predicate(tree):
                return True
            time.sleep(0.1)
        return False

    def finish(self, timeout: float) -> tuple[int, str]:
        self.watch_until(lambda tree: False, timeout)
        output = self.process.communicate(timeout=timeout)[0]
        return self.process.returncode, output

    def left_behind(self, wait_s: float = 5.0) -> dict[int, str]:
        """Processes of this run still alive after waiting up to ``wait_s`` for them to go."""
        deadline = time.monotonic() + wait_s
        while alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        return alive(self.seen)

    def assert_nothing_left(self, wait_s: float = 5.0) -> None:
        left = self.left_behind(wait_s)
        assert not left, f"left behind: {left}"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the launcher as a user would: SIGTERM to it alone, then wait up to ``grace_s``
        while it ends its ranks and removes a private Ray cluster, temp dir included (a few
        seconds); its output is read (so that it never blocks on a full pipe) and dropped."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.communicate(timeout=grace_s)

    def close(self) -> None:
        """Teardown: ``stop`` (a shorter wait: a launcher that does not end by itself in time,
        torchrun's for one, is not waited for), then kill whatever the run left (every process it
        was seen to start) and remove the temp dir of a private Ray cluster it could not."""
        self.stop(CLOSE_GRACE_S)
        kill_all([self.process.pid, *self.seen], grace_s=2.0)
        with contextlib.suppress(Exception):
            self.process.communicate(timeout=5)
        for temp_dir in ray_temp_dirs(self.process.pid):
            shutil.rmtree(temp_dir, ignore_errors=True)
