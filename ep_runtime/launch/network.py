"""Which network interface a rank's gloo and NCCL sockets use, and who chose it.

Precedence, per variable and per rank (``GLOO_SOCKET_IFNAME`` for gloo, ``NCCL_SOCKET_IFNAME``
for NCCL's bootstrap and socket transport):

1. a value already in the rank's environment: set in that node's ``ray start`` environment (or
   for every node in the job's runtime env); the launcher never forwards the driver's value;
2. the launcher's default, the interface that holds the address the rank's peers reach it by:
   on a run within one host (spawn, torchrun on one node, Ray on one node) the loopback
   interface, so that nothing of the run listens beyond the machine; on a Ray run across nodes
   the IP address Ray registered for the rank's node;
3. otherwise (torchrun across nodes: no launcher knows the address) torch's and NCCL's own
   choice (gloo: the address the host name resolves to, which is a loopback address where
   ``/etc/hosts`` maps the host name to ``127.0.1.1``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from collections.abc import MutableMapping

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"
NCCL_INTERFACE = "NCCL_SOCKET_IFNAME"
INTERFACE_VARIABLES = (GLOO_INTERFACE, NCCL_INTERFACE)
# describe one node's network: a driver's value would be wrong on every other node
NODE_LOCAL_VARIABLES = (*INTERFACE_VARIABLES, "TP_SOCKET_IFNAME", "NCCL_IB_HCA")

SOURCE_NODE = "node"  # already in the rank's environment
SOURCE_LAUNCHER = "launcher"  # the interface holding the address peers reach the rank by
SOURCE_TORCH = "torch"  # left unset: torch / NCCL choose


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _IfAddrs(ctypes.Structure):
    """``struct ifaddrs`` of glibc and musl (Linux)."""


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("broadcast_or_destination", ctypes.POINTER(_SockAddr)),
    ("data", ctypes.c_void_p),
]

# offset and length of the address inside sockaddr_in / sockaddr_in6, after the family field
_ADDRESS_BYTES = {socket.AF_INET: (2, 4), socket.AF_INET6: (6, 16)}


def interface_addresses() -> list[tuple[str, str]]:
    """Every (interface name, IP address) of this machine, IPv4 and IPv6, from ``getifaddrs``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: list[tuple[str, str]] = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr and item.addr.contents.family in _ADDRESS_BYTES:
                family = item.addr.contents.family
                offset, length = _ADDRESS_BYTES[family]
                base = ctypes.addressof(item.addr.contents) + ctypes.sizeof(ctypes.c_ushort)
                raw = ctypes.string_at(base + offset, length)  # sockaddr_in6 outgrows sockaddr
                found.append((item.name.decode(), socket.inet_ntop(family, raw)))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def interface_holding(address: str) -> str | None:
    """The name of the local interface that holds ``address``; ``None`` if none does."""
    wanted = ipaddress.ip_address(address)
    for name, held in interface_addresses():
        if ipaddress.ip_address(held.split("%")[0]) == wanted:
            return name.split(":")[0]  # an alias label (eth0:1) belongs to its interface
    return None


def apply_interface_defaults(
    node_ip: str | None, environ: MutableMapping[str, str] | None = None
) -> dict[str, dict[str, str | None]]:
    """Set the launcher's default interface (see the module docstring) where the rank's
    environment has none, before the process group is created; returns, per variable, the
    value in force and its source (``node``, ``launcher`` or ``torch``).

    ``node_ip`` is the address the rank's peers reach it by: ``rendezvous.LOOPBACK`` on a run
    within one host, the address Ray registered for the rank's node on a run across nodes;
    ``None`` where no launcher knows it (torchrun across nodes)."""
    env = os.environ if environ is None else environ
    interface = interface_holding(node_ip) if node_ip else None
    chosen: dict[str, dict[str, str | None]] = {}
    for variable in INTERFACE_VARIABLES:
        if env.get(variable):
            chosen[variable] = {"value": env[variable], "source": SOURCE_NODE}
        elif interface is not None:
            # NCCL matches a prefix unless the name starts with "="; gloo wants the exact name
            value = f"={interface}" if variable == NCCL_INTERFACE else interface
            env[variable] = value
            chosen[variable] = {"value": value, "source": SOURCE_LAUNCHER}
        else:
            chosen[variable] = {"value": None, "source": SOURCE_TORCH}
    return chosen
