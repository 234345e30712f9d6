"""A run within one host lets no one in (issue 26): the sockets its processes listen on, sampled
from outside with psutil while the run is alive, are all on loopback. The rendezvous store is the
one torch would bind to every interface (shown here as the control); gloo follows the loopback
interface the launcher sets. Under Ray, Ray's own services listen on loopback too (the launcher
starts its private cluster on 127.0.0.1); they are reported apart, with what each answers to a
client without Ray's token.

Each run is then ended as a user ends one (a run costs seconds of start-up, so one run serves
both): the spawn run by Ctrl-C to its process group, the Ray run by SIGINT to the launcher, and
the checks of those ends (tests/launch/test_launch_runs.py, test_launch_ray.py) are made here:
exit 130 within 10 s, every process of the run gone, the Ray cluster's temp dir too."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from ep_runtime.launch.cli import EXIT_INTERRUPTED
from ep_runtime.launch.network import interface_addresses
from ep_runtime.launch.rendezvous import LOOPBACK, host_store, join_store
from tests.support.listeners import (
    Listener,
    by_pid,
    http_without_token,
    listening,
    listening_in_namespace,
    ray_grpc_ports,
    ray_session_dir,
    sample,
)
from tests.support.processes import (
    Run,
    alive,
    cpu_seconds,
    descendants,
    kill_all,
    ray_temp_dirs,
)

RUN_TIMEOUT_S = 150  # rank start-up on a busy 2-core box takes up to a minute
INTERRUPT_BUDGET_S = 10.0  # an interrupted run must end within this
LONG_RUN = ("--dp", "2", "--iters", "1000000", "--warmup", "1", "--no-baselines")
PATHS = ("/metrics", "/api/local_raylet_healthz")  # Prometheus; the agent's health URL
GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"


def _new_listeners(before: set[Listener]) -> set[Listener]:
    return listening([os.getpid()]) - before


def _tree(run: Run) -> list[int]:
    """The run's processes now; each is remembered for the teardown (``Run.close``)."""
    tree = descendants(run.process.pid)
    run.seen.update({pid: cmd for pid, cmd in tree.items() if cmd.strip() or pid not in run.seen})
    return [run.process.pid, *tree]


def _remote_ends(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the far end of each TCP connection of ``pid``."""
    return {
        (c.raddr.ip.removeprefix("::ffff:"), c.raddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr
    }


def _command(pid: int) -> str:
    """The process's command line, its program by name only (``gcs_server …``, ``ray::…``)."""
    try:
        program, *arguments = psutil.Process(pid).cmdline()
    except (psutil.Error, ValueError):
        return "?"
    return " ".join([Path(program).name, *arguments])


def _describe(listeners: set[Listener]) -> str:
    return "; ".join(f"{item} ({_command(item.pid)[:60]})" for item in sorted(listeners, key=str))


def _interrupt(run: Run, group: bool) -> tuple[int, str]:
    """SIGINT to the run's process group (a terminal's Ctrl-C) or to the launcher alone; its
    exit code and output, checked to come within ``INTERRUPT_BUDGET_S``."""
    if group:
        os.killpg(run.process.pid, signal.SIGINT)  # the run is its own process group
    else:
        run.process.send_signal(signal.SIGINT)
    interrupted_at = time.monotonic()
    code, output = run.finish(timeout=60)
    assert time.monotonic() - interrupted_at < INTERRUPT_BUDGET_S, output
    return code, output


# the store helper -------------------------------------------------------------------------------
def test_torch_store_listens_everywhere_but_ours_on_its_address_only():
    """The control first: a plain TCPStore given 127.0.0.1 listens on every interface (what the
    issue saw). ``host_store`` listens on exactly the address it is given, and clients use it."""
    before = listening([os.getpid()])
    plain = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    assert any(not item.loopback for item in _new_listeners(before)), "control: torch changed?"
    del plain
    before = listening([os.getpid()])
    store = host_store(LOOPBACK, 2, timeout_s=10)
    assert _new_listeners(before) == {Listener(os.getpid(), LOOPBACK, store.port)}
    join_store(LOOPBACK, store.port, 2, timeout_s=10).set("key", "value")
    assert store.get("key") == b"value"
    # the /proc reading the two-host test uses agrees with psutil's
    assert listening_in_namespace([os.getpid()]) == listening([os.getpid()])
    routable = [a for name, a in interface_addresses() if "." in a and not a.startswith("127.")]
    if routable:  # the address a multi-host run would bind
        before = listening([os.getpid()])
        outward = host_store(routable[0], 1, timeout_s=10)
        assert _new_listeners(before) == {Listener(os.getpid(), routable[0], outward.port)}


# runs ---------------------------------------------------------------------------------------------
def _spawn_ranks(root: int) -> list[int]:
    return [pid for pid, cmd in descendants(root).items() if "spawn_main" in cmd]


def test_spawn_run_listens_on_loopback_only_and_ctrl_c_stops_every_rank(launcher_runs):
    """W = 2: the parent's store and each rank's gloo listener, nothing else, all on loopback;
    the ranks reach the store and each other through them. Then Ctrl-C (SIGINT to every
    process of the run's group, as a terminal does) once the ranks are in their timed loop:
    exit 130, "interrupted" without a traceback, no rank left."""
    run = launcher_runs("--launcher", "spawn", *LONG_RUN)
    root = run.process.pid

    def enough(seen: set[Listener]) -> bool:
        ranks = _spawn_ranks(root)
        return len(ranks) == 2 and all(pid in by_pid(seen) for pid in (root, *ranks))

    seen = sample(lambda: _tree(run), enough, RUN_TIMEOUT_S)
    assert run.process.poll() is None, run.finish(10)[1]
    ranks = _spawn_ranks(root)
    assert enough(seen), f"ranks never listened within {RUN_TIMEOUT_S} s: {_describe(seen)}"
    outside = {item for item in seen if not item.loopback}
    assert not outside, f"listening beyond loopback: {_describe(outside)}"
    grouped = by_pid(seen)
    assert set(grouped) == {root, *ranks}  # the resource tracker listens on nothing
    [store] = grouped[root]
    store_socket = (store.address, store.port)
    gloo = {}
    for rank in ranks:
        # a rank sampled between the spawn's fork and its exec still holds the parent's store
        # socket (seen once, under two pytest workers): the store's (address, port) is not its own
        own = [item for item in grouped[rank] if (item.address, item.port) != store_socket]
        assert len(own) == 1, f"rank {rank}: {_describe(set(grouped[rank]))}"
        gloo[rank] = own[0]
        assert (store.address, store.port) in _remote_ends(rank)  # a client of the store
    first, second = ranks  # of each pair of ranks, one connected to the other's listener
    assert (gloo[second].address, gloo[second].port) in _remote_ends(first) or (
        gloo[first].address,
        gloo[first].port,
    ) in _remote_ends(second)

    def busy(tree: dict[int, str]) -> bool:  # 3 s of CPU each (torch, the group): timed loop
        return all(cpu_seconds(pid) >= 3.0 for pid in ranks)

    assert run.watch_until(busy, timeout=120), "ranks never got going"
    code, output = _interrupt(run, group=True)
    assert code == EXIT_INTERRUPTED, output
    assert "interrupted" in output and "KeyboardInterrupt" not in output
    assert not alive(ranks)
    run.assert_nothing_left()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
def test_local_ray_run_listens_on_loopback_only_and_ctrl_c_tears_it_down(launcher_runs, capsys):
    """W = 2 on a local Ray cluster: every process of the run listens on loopback only, Ray's
    own services included (the launcher starts Ray on 127.0.0.1: ``node_on_loopback``). In the
    driver and the rank actors, every listener that is not one of Ray's gRPC servers (Ray logs
    each with its pid and port) is ours: the store and one gloo listener per rank. The GCS
    refuses a call without Ray's token; with the ``cluster`` extra (``ray[default]``) Ray's
    agent serves metrics that answer without it (all such listeners are reported: the table in
    docs/security.md). Then Ctrl-C to the launcher while the ranks run: exit 130, "interrupted",
    every process of the run gone and its private cluster's temp dir removed."""
    import grpc
    from ray._private.utils import get_dashboard_dependency_error

    run = launcher_runs(*LONG_RUN)
    root = run.process.pid

    def actors() -> list[int]:
        return [pid for pid, cmd in descendants(root).items() if cmd.startswith("ray::RankActor")]

    def running(seen: set[Listener]) -> bool:
        tree = descendants(root)
        return sum(cmd.startswith("ray::RankActor.step") for cmd in tree.values()) == 2

    seen = sample(lambda: _tree(run), running, RUN_TIMEOUT_S)
    assert run.process.poll() is None, run.finish(10)[1]
    assert running(seen), f"rank actors never ran within {RUN_TIMEOUT_S} s"
    outside = {item for item in seen if not item.loopback}
    assert not outside, f"listening beyond loopback: {_describe(outside)}"
    tree = descendants(root)
    session = ray_session_dir(tree.values())
    assert session is not None, "no raylet among the run's processes"
    ray_ports = ray_grpc_ports(session)
    assert ray_ports, f"no gRPC server lines in {session}/logs"
    ours_pids = {root, *actors()}
    ours = {
        item for item in seen if item.pid in ours_pids and (item.pid, item.port) not in ray_ports
    }
    assert len(ours) == 1 + 2, f"expected the store and 2 gloo listeners: {_describe(ours)}"
    # Ray's own, now (the run is alive): gRPC (known by the logs) or HTTP, asked without a token
    rays = listening(_tree(run)) - ours
    answers = {
        item: "gRPC" if (item.pid, item.port) in ray_ports else http_without_token(item, PATHS)
        for item in rays
    }
    with capsys.disabled():
        print("\nRay's own listeners, asked without the token:")
        for item in sorted(rays, key=lambda item: (_command(item.pid)[:20], item.port)):
            print(f"  {item} ({_command(item.pid)[:40]}): {answers[item]}")
    [gcs] = [pid for pid, cmd in tree.items() if "gcs_server" in cmd.split()[0]]
    assert psutil.Process(gcs).environ().get("RAY_AUTH_MODE") == "token"
    [gcs_port] = [port for pid, port in ray_ports if pid == gcs]
    channel = grpc.insecure_channel(f"{LOOPBACK}:{gcs_port}")
    with channel, pytest.raises(grpc.RpcError) as refused:  # the GCS asks for the token
        channel.unary_unary(GCS_METHOD)(b"", timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    if get_dashboard_dependency_error() is None:  # ray[default]: the agent's metrics export
        [agent] = [pid for pid, cmd in tree.items() if cmd.startswith("ray::DashboardAgent")]
        open_to_all = [item for item, answer in answers.items() if answer != "gRPC"
                       and answer["/metrics"] == 200]  # fmt: skip
        assert any(item.pid == agent for item in open_to_all), _describe(rays)
    assert running(set()), "the ranks stopped before the interrupt"
    code, output = _interrupt(run, group=False)
    assert code == EXIT_INTERRUPTED, output
    assert "interrupted" in output
    run.assert_nothing_left()
    assert ray_temp_dirs(root) == []


def test_torchrun_on_one_node_ranks_listen_on_loopback_only(launcher_runs, capsys):
    """``torchrun --standalone``: each rank's gloo listener is on loopback; the store is
    torchrun's own (its agent's, bound by torch to every interface), reported apart."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    prefix = (torchrun, "--standalone", "--nproc-per-node", "2", "--no-python")
    run = launcher_runs("--launcher", "torchrun", *LONG_RUN, "--device", "cpu", prefix=prefix)
    root = run.process.pid

    def ranks() -> list[int]:
        return [pid for pid, cmd in descendants(root).items() if "ep_runtime.launch" in cmd]

    def enough(seen: set[Listener]) -> bool:
        return len(ranks()) == 2 and all(pid in by_pid(seen) for pid in ranks())

    seen = sample(lambda: _tree(run), enough, RUN_TIMEOUT_S)
    assert run.process.poll() is None, run.finish(10)[1]
    assert enough(seen), f"ranks never listened within {RUN_TIMEOUT_S} s: {_describe(seen)}"
    agent = {item for item in seen if item.pid not in ranks()}
    # a rank sampled between torchrun's fork and its exec still holds the agent's sockets: the
    # same (address, port) as an agent listener is that socket, not one the rank opened
    agent_sockets = {(item.address, item.port) for item in agent}
    grouped = by_pid(item for item in seen if (item.address, item.port) not in agent_sockets)
    for rank in ranks():
        own = grouped.get(rank, set())
        assert len(own) == 1 and all(item.loopback for item in own), _describe(own)
    with capsys.disabled():
        print(f"\ntorchrun's own listeners: {_describe(agent)}")
    # torchrun's agent outlives a SIGINT or SIGTERM by over 30 s here (the teardown would wait
    # its grace first): nothing is checked of this run's end, so it is killed at once
    kill_all([run.process.pid, *run.seen], grace_s=0)
