"""Two hosts on one machine, as in issue 15: each host is a network namespace with its own address
(a veth pair in a private /24 that only this test creates), its own host name and its own
``/etc/hosts`` (a UTS and a mount namespace with a bind-mounted file), and one Ray node with token
auth. The launcher is submitted with ``ray job submit`` to the head and runs 2 ranks per host.

Cases: ``/etc/hosts`` mapping the host name to the host's own address and to ``127.0.1.1`` (the
Debian default that broke gloo), with no interface variable; a per-node ``GLOO_SOCKET_IFNAME``
that differs between the hosts; a bogus interface name on host B only, which must be blamed on a
rank of host B with its own error. While a job runs, the sockets its processes listen on are
read in each namespace: the store and gloo listen on their host's address only, not on every
interface. Everything is torn down by namespace and PID, and checked gone.
Needs root (or the skip says what is missing); uses 2 CPUs and about a minute.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.listeners import Listener, listening_in_namespace, ray_grpc_ports
from tests.support.processes import ENV, alive, command_line, kill_all, process_table

SUBNET = "10.213.71"  # private /24, lives only inside the two namespaces
GLOO = "GLOO_SOCKET_IFNAME"
RAY_BIN = Path(sys.executable).parent / "ray"
JOB_TIMEOUT_S = 150
# 20 timed iterations: the ranks' listening window lasts a few sampling periods (with 2 it was
# sometimes shorter than one sampling pass on a loaded machine, and no listener was seen)
LAUNCH_ARGS = ("--dp", "4", "--address", "auto", "--iters", "20", "--warmup", "1",
               "--no-baselines", "--timeout", "30")  # fmt: skip


def _missing_prerequisite() -> str | None:
    """Why namespaces or a Ray cluster cannot be made here, or ``None``."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"network namespaces need the {tool!r} command"
    if importlib.util.find_spec("aiohttp") is None or not RAY_BIN.exists():
        return "ray job submit needs ray[default]"
    return None


@dataclass
class Host:
    """One simulated host: a network namespace, one end of the veth pair, a host name and an
    ``/etc/hosts`` of its own, held by a ``sleep`` process that commands join with nsenter."""

    name: str  # host name
    netns: str
    interface: str
    address: str
    hosts_file: Path
    temp_dir: Path  # Ray's --temp-dir for this node
    holder: subprocess.Popen | None = None
    ray_env: dict[str, str] = field(default_factory=dict)

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's network, UTS and mount namespaces."""
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-u", "-m", "--", *argv]

    def write_hosts(self, own_name_to_loopback: bool) -> None:
        """Debian style (``127.0.1.1 name``) or the host's own address; same inode, so the
        bind mount sees it."""
        address = "127.0.1.1" if own_name_to_loopback else self.address
        self.hosts_file.write_text(f"127.0.0.1 localhost\n{address} {self.name}\n")


def _run(argv: list[str], env: dict | None = None, timeout: float = 60) -> str:
    """Run a set-up command; its output, or a failure naming it."""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stdout}{done.stderr}"
    return done.stdout


class TwoHosts:
    """Both hosts, the Ray cluster across them, and a teardown that leaves nothing."""

    def __init__(self, tag: str, root: Path, token: str) -> None:
        self.root = root
        self.token = token
        self.hosts = [
            Host(
                name=f"epnode-{letter}",
                netns=f"ep{tag}{letter}",
                interface=f"epv{tag}{letter}",  # different names on the two hosts
                address=f"{SUBNET}.{index + 1}",
                hosts_file=root / f"hosts-{letter}",
                temp_dir=root / f"ray-{letter}",
            )
            for index, letter in enumerate("ab")
        ]
        self.node_env: list[dict | None] = [None, None]  # extra variables of each running node

    # namespaces -----------------------------------------------------------------------------
    def create(self) -> None:
        a, b = self.hosts
        for host in self.hosts:
            _run(["ip", "netns", "add", host.netns])
        _run(["ip", "link", "add", a.interface, "type", "veth", "peer", "name", b.interface])
        for host in self.hosts:
            _run(["ip", "link", "set", host.interface, "netns", host.netns])
            inside = ["ip", "-n", host.netns]
            _run([*inside, "addr", "add", f"{host.address}/24", "dev", host.interface])
            _run([*inside, "link", "set", host.interface, "up"])
            _run([*inside, "link", "set", "lo", "up"])
            host.write_hosts(own_name_to_loopback=False)
            host.temp_dir.mkdir()
            setup = (
                f"hostname {host.name} && mount --bind {host.hosts_file} /etc/hosts "
                "&& echo ready && exec sleep 100000"
            )
            own_namespaces = ["unshare", "--uts", "--mount", "--propagation", "private"]
            host.holder = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *own_namespaces, "sh", "-c", setup],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            line = host.holder.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(
                    f"host {host.name} set-up failed: {line}{host.holder.stdout.read()}"
                )

    def destroy(self) -> None:
        """Kill every process in either namespace (Ray nodes, jobs, holders), then delete the
        namespaces (the veth pair goes with them) and the temp dir."""
        self.stop_ray()
        for host in self.hosts:
            kill_all(self._netns_pids(host.netns), grace_s=2)
            if host.holder is not None:
                host.holder.wait(10)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)
            # a set-up that failed before moving the veth pair leaves it here; deleting one end
            # deletes both
            subprocess.run(["ip", "link", "del", host.interface], capture_output=True, timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Anything of this test still on the machine."""
        found = []
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        for host in self.hosts:
            if host.netns in netns.split():
                found.append(f"namespace {host.netns}")
            if host.interface in links:
                found.append(f"interface {host.interface}")
        processes = {
            pid: cmd for pid, (_, _, cmd) in process_table().items() if str(self.root) in cmd
        }
        found += [f"process {pid}: {cmd[:80]}" for pid, cmd in alive(processes).items()]
        if self.root.exists():
            found.append(f"directory {self.root}")
        return found

    @staticmethod
    def _netns_pids(netns: str) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split()]

    # Ray ------------------------------------------------------------------------------------
    def env(self, host: Host, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A node's environment: token auth, this worktree's package, a private HOME."""
        return ENV | {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "HOME": str(self.root),
            "PATH": f"{RAY_BIN.parent}{os.pathsep}{os.environ['PATH']}",
        } | (extra or {})  # fmt: skip

    def cluster(self, env_a: dict[str, str], env_b: dict[str, str]) -> None:
        """A head on host A and a worker on host B, started with these extra variables; a node
        already running with its variables is kept (a new head needs a new worker)."""
        a, b = self.hosts
        if self.node_env[0] != env_a:
            self.stop_ray(a, b)
            self.start_node(a, env_a)
        if self.node_env[1] != env_b:
            self.stop_ray(b)
            self.start_node(b, env_b)

    def start_node(self, host: Host, extra: dict[str, str]) -> None:
        head = self.hosts[0]
        role = (
            ["--head", "--dashboard-host", "0.0.0.0"]
            if host is head
            else ["--address", f"{head.address}:6379"]
        )
        _run(
            host.command(
                str(RAY_BIN), "start", *role, "--node-ip-address", host.address,
                "--temp-dir", str(host.temp_dir), "--num-cpus", "2",
                "--object-store-memory", "100000000", "--disable-usage-stats",
            ),
            env=self.env(host, extra),
            timeout=120,
        )  # fmt: skip
        self.node_env[self.hosts.index(host)] = dict(extra)

    def stop_ray(self, *hosts: Host) -> None:
        """Every process in these hosts' namespaces (all by default) but the holders; ``ray
        stop`` would stop every Ray of the machine, other users' too."""
        hosts = hosts or tuple(self.hosts)
        holders = {h.holder.pid for h in hosts if h.holder is not None}
        doomed = [p for h in hosts for p in self._netns_pids(h.netns) if p not in holders]
        kill_all(doomed, grace_s=5)
        for host in hosts:
            self.node_env[self.hosts.index(host)] = None

    def submit(
        self, report: Path, watch: bool = True
    ) -> tuple[subprocess.CompletedProcess, dict[str, set[Listener]]]:
        """``ray job submit`` of the launcher from host A, waiting for the job to end; and (if
        ``watch``), by host name, what the run's own processes (its driver, the rank actors)
        listened on meanwhile, less Ray's own gRPC servers (by Ray's log lines)."""
        a = self.hosts[0]
        argv = a.command(
            str(RAY_BIN), "job", "submit", "--address", f"http://{a.address}:8265", "--",
            "python", "-m", "ep_runtime.launch", *LAUNCH_ARGS, "--json", str(report),
        )  # fmt: skip
        seen: dict[str, set[Listener]] = {host.name: set() for host in self.hosts}
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            job = subprocess.Popen(argv, env=self.env(a), stdout=out, stderr=err, text=True)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while watch and job.poll() is None and time.monotonic() < deadline:
                for host in self.hosts:
                    run = [p for p in self._netns_pids(host.netns) if _of_the_run(p)]
                    seen[host.name] |= listening_in_namespace(run)
                time.sleep(0.1)
            try:
                job.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                job.kill()
                raise
            out.seek(0), err.seek(0)
            done = subprocess.CompletedProcess(argv, job.returncode, out.read(), err.read())
        for host in self.hosts:
            rays = ray_grpc_ports(host.temp_dir / "session_latest")
            seen[host.name] = {
                item for item in seen[host.name] if (item.pid, item.port) not in rays
            }
        return done, seen


def _of_the_run(pid: int) -> bool:
    """The launcher's driver (not ``ray job submit``) or one of its rank actors."""
    command = command_line(pid)
    return command.startswith("ray::RankActor") or (
        "ep_runtime.launch" in command and "job submit" not in command
    )


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[TwoHosts]:
    missing = _missing_prerequisite()
    if missing:
        pytest.skip(f"cannot simulate two hosts here: {missing}")
    tag = secrets.token_hex(2)
    root = Path(tempfile.mkdtemp(prefix=f"epmh{tag}_", dir="/tmp"))
    pair = TwoHosts(tag, root, token=secrets.token_hex(16))
    try:
        probe = subprocess.run(["ip", "netns", "add", pair.hosts[0].netns], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot simulate two hosts here: ip netns add: {probe.stderr.decode()}")
        subprocess.run(["ip", "netns", "del", pair.hosts[0].netns], capture_output=True)
        pair.create()
        yield pair
    finally:
        pair.destroy()
        left = pair.leftovers()
        assert not left, f"left behind: {left}"


def _check_ranks_on_both_hosts(pair: TwoHosts, submitted, report: Path) -> dict:
    job, listeners = submitted
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    assert "succeeded" in output and "PASSED" in output
    data = json.loads(report.read_text())
    a, b = pair.hosts
    assert data["passed"] and data["world_size"] == 4 and data["launcher"] == "ray"
    placement = [(r["rank"], r["host"], r["node_ip"]) for r in data["per_rank"]]
    assert placement == [
        (0, a.name, a.address), (1, a.name, a.address),
        (2, b.name, b.address), (3, b.name, b.address),
    ]  # fmt: skip
    assert all(r["passed"] for r in data["per_rank"])
    # the store (rank 0, host A) and each rank's gloo listener, on its host's address only
    for host in pair.hosts:
        assert all(item.address == host.address for item in listeners[host.name]), listeners
    assert [len(listeners[host.name]) for host in pair.hosts] == [1 + 2, 2], listeners
    return data


def test_ranks_run_on_both_hosts_without_interface_variables(two_hosts, tmp_path):
    """No interface variable anywhere: each rank binds gloo to the interface holding its node's
    IP, so the Debian-style ``/etc/hosts`` (the host name on 127.0.1.1, the case that broke
    gloo) no longer sends peers to 127.0.1.1. (The host name on its own address, the easy case,
    is the bad-interface test's set-up, where host A's ranks run.)"""
    for host in two_hosts.hosts:
        host.write_hosts(own_name_to_loopback=True)
    two_hosts.cluster({}, {})
    report = tmp_path / "report.json"
    data = _check_ranks_on_both_hosts(two_hosts, two_hosts.submit(report), report)
    by_name = {h.name: h for h in two_hosts.hosts}
    for rank in data["per_rank"]:
        gloo = rank["interfaces"][GLOO]
        assert gloo == {"value": by_name[rank["host"]].interface, "source": "launcher"}


def test_per_node_interface_variables_win(two_hosts, tmp_path):
    """Each node's own ``GLOO_SOCKET_IFNAME`` (the veth names differ) reaches its ranks; the
    driver's (host A's) value is not forwarded to host B, where that interface does not exist."""
    a, b = two_hosts.hosts
    for host in two_hosts.hosts:
        host.write_hosts(own_name_to_loopback=True)
    two_hosts.cluster({GLOO: a.interface}, {GLOO: b.interface})
    report = tmp_path / "report.json"
    data = _check_ranks_on_both_hosts(two_hosts, two_hosts.submit(report), report)
    for rank in data["per_rank"]:
        expected = a.interface if rank["host"] == a.name else b.interface
        assert rank["interfaces"][GLOO] == {"value": expected, "source": "node"}


def test_bad_interface_on_one_host_is_blamed_on_a_rank_of_that_host(two_hosts, tmp_path):
    """Host B names an interface it does not have: a rank of host B is reported, with its own
    gloo error, not rank 0 "hung" (every gloo set-up traceback mentions ProcessGroupGloo)."""
    a, b = two_hosts.hosts
    for host in two_hosts.hosts:
        host.write_hosts(own_name_to_loopback=False)
    two_hosts.cluster({GLOO: a.interface}, {GLOO: "bogus0"})  # A as above: only B restarts
    report = tmp_path / "report.json"
    started = time.monotonic()
    job, _ = two_hosts.submit(report, watch=False)  # timed: no sampling beside it
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "exit code 3" in output, output
    data = json.loads(report.read_text())
    assert data["failed_rank"] in (2, 3), data["error"]  # ranks 2 and 3 run on host B
    error = data["error"]
    assert error.startswith(f"rank {data['failed_rank']} (raised during step process group init)")
    assert f"ip={b.address}" in error  # Ray's header of the failed call: the actor on host B
    assert "Unable to find address for: bogus0" in error
    assert "hung" not in error
    assert time.monotonic() - started < 90
