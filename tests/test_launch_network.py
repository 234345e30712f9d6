"""Which interface a rank's gloo and NCCL sockets use: the interface lookup checked against
``ip -o addr`` (an independent reading of the machine), and the precedence of a node's own
setting over the launcher's default over torch's."""

from __future__ import annotations

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
    chosen = apply_interface_defaults(None, one_node)  # one-node run: torch decides
    assert all(c == {"value": None, "source": "torch"} for c in chosen.values())
    assert one_node == {}
    nowhere: dict[str, str] = {}
    apply_interface_defaults("198.51.100.77", nowhere)  # not an address of this machine
    assert nowhere == {}
