"""Which interface a rank's gloo and NCCL sockets use: the interface lookup checked against
``ip -o addr`` (an independent reading of the machine), and the precedence of a node's own
setting over the launcher's default over torch's. Where torchrun / srun ranks find their store:
loopback within one host, else the address MASTER_ADDR names (checked with psutil)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ep_runtime.launch.network import (
    GLOO_INTERFACE,
    NCCL_INTERFACE,
    apply_interface_defaults,
    interface_addresses,
    interface_holding,
)
from ep_runtime.launch.rendezvous import LOOPBACK, join_store
from ep_runtime.launch.spec import LaunchError
from ep_runtime.launch.torchrun import EnvRank, own_address, rendezvous_store, single_host
from tests.support.listeners import Listener, listening


def _ip_addresses() -> list[tuple[str, str]]:
    """(interface, address) pairs as ``ip -o addr`` lists them."""
    if shutil.which("ip") is None:
        pytest.skip("the 'ip' command is not installed")
    listing = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
    pairs = []
    for line in listing.stdout.splitlines():
        fields = line.split()  # "2: eth0    inet 192.0.2.2/24 brd ..."
        pairs.append((fields[1], fields[3].split("/")[0]))
    return pairs


def test_interface_lookup_agrees_with_ip_addr():
    expected = _ip_addresses()
    assert sorted(interface_addresses()) == sorted(expected)
    for name, address in expected:
        assert interface_holding(address) == name
    assert interface_holding("127.0.0.1") == "lo"


def test_an_address_no_interface_holds_has_no_interface():
    held = {address for _, address in _ip_addresses()}
    unheld = next(f"198.51.100.{n}" for n in range(1, 255) if f"198.51.100.{n}" not in held)
    assert interface_holding(unheld) is None


def test_node_setting_beats_launcher_default_beats_torch():
    environ = {GLOO_INTERFACE: "ib0"}  # set for this node (ray start environment)
    chosen = apply_interface_defaults("127.0.0.1", environ)
    assert chosen[GLOO_INTERFACE] == {"value": "ib0", "source": "node"}
    assert chosen[NCCL_INTERFACE] == {"value": "=lo", "source": "launcher"}  # exact-match form
    assert environ == {GLOO_INTERFACE: "ib0", NCCL_INTERFACE: "=lo"}
    one_node: dict[str, str] = {}
    chosen = apply_interface_defaults(None, one_node)  # no address known: torch decides
    assert all(c == {"value": None, "source": "torch"} for c in chosen.values())
    assert one_node == {}
    nowhere: dict[str, str] = {}
    apply_interface_defaults("198.51.100.77", nowhere)  # not an address of this machine
    assert nowhere == {}


def test_one_host_runs_get_the_loopback_interface():
    environ: dict[str, str] = {}
    chosen = apply_interface_defaults(LOOPBACK, environ)
    loopback = interface_holding(LOOPBACK)
    assert environ == {GLOO_INTERFACE: loopback, NCCL_INTERFACE: f"={loopback}"}
    assert chosen[GLOO_INTERFACE] == {"value": loopback, "source": "launcher"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node1"}, True),  # torchrun, one node
        ({"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node1"}, False),  # torchrun, two nodes
        ({"SLURM_NNODES": "1", "MASTER_ADDR": "node1"}, True),
        ({"SLURM_JOB_NUM_NODES": "1", "MASTER_ADDR": "node1"}, True),
        ({"SLURM_NNODES": "2", "MASTER_ADDR": "10.0.0.5"}, False),
        ({"MASTER_ADDR": "127.0.0.1"}, True),
        ({"MASTER_ADDR": "::1"}, True),
        ({"MASTER_ADDR": "localhost"}, True),
        ({"MASTER_ADDR": "10.0.0.5"}, False),
    ],
)
def test_single_host_from_the_job_runners_variables(environ, expected):
    assert single_host(EnvRank(0, 4, 0), environ) is expected


def test_torchrun_rank_0_hosts_the_store_on_loopback_within_one_host():
    before = listening([os.getpid()])
    environ = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "0"}  # port 0: the kernel's pick
    store = rendezvous_store(EnvRank(0, 2, 0), True, 10, environ)
    assert listening([os.getpid()]) - before == {Listener(os.getpid(), LOOPBACK, store.port)}
    join_store(LOOPBACK, store.port, 2, 10).set("k", "v")
    assert store.get("k") == b"v"
    agent = {**environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}  # torchrun's agent hosts it
    assert rendezvous_store(EnvRank(1, 2, 1), True, 10, agent) is None


def test_across_hosts_rank_0_binds_the_address_master_addr_names():
    held = [a for _, a in _ip_addresses() if not a.startswith(("127.", "::1", "fe80"))]
    if held:
        assert own_address(held[0]) == held[0]
    with pytest.raises(LaunchError, match=r"MASTER_ADDR=127\.0\.0\.1 resolves to"):
        own_address("127.0.0.1")  # the other hosts could not reach it
    unheld = next(f"198.51.100.{n}" for n in range(1, 255) if f"198.51.100.{n}" not in held)
    with pytest.raises(LaunchError, match="none of them a non-loopback address of this host"):
        own_address(unheld)
