"""Which TCP sockets processes listen on, read from outside them: psutil for one look at
processes in this network namespace; ``/proc`` for a process in any namespace and for sampling a
run ten times a second (each namespace's ``/proc/<pid>/net/tcp*`` read once a pass, not once a
process: a read costs milliseconds of kernel time here, psutil's once a process took 150 ms of
CPU a pass for 15 processes). Also which listeners are Ray's own, by Ray's own log lines, and
what a listener answers in HTTP to a client without Ray's token."""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        """On a loopback address; an IPv6 socket bound to an IPv4-mapped one (``::ffff:127.0.0.1``,
        how Ray's gRPC servers show) counts as its IPv4 address."""
        address = ipaddress.ip_address(self.address.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.address}:{self.port}"


def listening(pids: Iterable[int]) -> set[Listener]:
    """The TCP listeners (IPv4 and IPv6) of ``pids`` right now; a process gone is skipped."""
    found = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        found |= {
            Listener(pid, c.laddr.ip, c.laddr.port)
            for c in connections
            if c.status == psutil.CONN_LISTEN
        }
    return found


def sample(
    pids: Callable[[], Iterable[int]],
    enough: Callable[[set[Listener]], bool],
    timeout_s: float,
    settle_s: float = 1.0,
) -> set[Listener]:
    """Poll the listeners of ``pids()`` until ``enough(seen)``, then ``settle_s`` more (late
    ones); everything seen, or what was seen by ``timeout_s`` if it never was enough."""
    seen: set[Listener] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen |= listening_in_namespace(pids())
        if enough(seen):
            deadline = min(deadline, time.monotonic() + settle_s)
        time.sleep(0.1)
    return seen


def by_pid(listeners: Iterable[Listener]) -> dict[int, set[Listener]]:
    grouped: dict[int, set[Listener]] = {}
    for listener in listeners:
        grouped.setdefault(listener.pid, set()).add(listener)
    return grouped


# Ray ----------------------------------------------------------------------------------------
# "[2026-12-01 19:42:04,924 I 9912 9912] (gcs_server) grpc_server.cc:144: GcsServer server
# started, listening on port 41933."
_RAY_GRPC_LINE = re.compile(
    r"^\[\S+ \S+ \w (\d+) \d+\] (?:\(\w+\) )?grpc_server\.cc:\d+: .* listening on port (\d+)",
    re.MULTILINE,
)


def ray_session_dir(command_lines: Iterable[str]) -> Path | None:
    """The session directory named on a raylet's command line, if one is among them."""
    for command in command_lines:
        match = re.search(r"--session_dir=(\S+)", command)
        if match and "raylet" in command.split()[0]:
            return Path(match.group(1))
    return None


def ray_grpc_ports(session_dir: Path) -> set[tuple[int, int]]:
    """(pid, port) of every gRPC server Ray says it started in this session (GCS, raylet,
    driver and worker core workers), from its log lines."""
    found = set()
    for log in (session_dir / "logs").glob("*"):
        if log.is_file():
            text = log.read_text(errors="replace")
            found |= {(int(pid), int(port)) for pid, port in _RAY_GRPC_LINE.findall(text)}
    return found


def http_without_token(listener: Listener, paths: tuple[str, ...]) -> dict[str, int | None]:
    """The HTTP status each of ``paths`` gets from ``listener`` with no credentials (no Ray
    token); ``None`` where nothing answers in HTTP (a gRPC server, a closed socket)."""
    host = listener.address.removeprefix("::ffff:")
    host = f"[{host}]" if ":" in host else host
    answers: dict[str, int | None] = {}
    for path in paths:
        try:
            with urllib.request.urlopen(f"http://{host}:{listener.port}{path}", timeout=2) as reply:
                answers[path] = reply.status
        except urllib.error.HTTPError as error:
            answers[path] = error.code
        except (OSError, http.client.HTTPException):
            answers[path] = None
    return answers


# any network namespace ---------------------------------------------------------------------------
def _socket_inodes(pid: int) -> set[str]:
    """The inodes of ``pid``'s open sockets (none once it is gone)."""
    inodes = set()
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone
        return set()
    for fd in descriptors:
        with contextlib.suppress(OSError):  # closed since it was listed
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _listening_sockets(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every TCP listener in ``pid``'s network namespace, from its
    ``/proc/<pid>/net/tcp{,6}``."""
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A":  # 0A: TCP_LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found[inode] = (socket.inet_ntop(family, raw), int(hex_port, 16))
    return found


def listening_in_namespace(pids: Iterable[int]) -> set[Listener]:
    """Like ``listening``, for processes in any network namespace (needs their /proc): each
    process's socket inodes matched against its namespace's listeners, read once for all the
    processes of that namespace."""
    by_namespace: dict[str, list[int]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):  # gone
            by_namespace.setdefault(os.readlink(f"/proc/{pid}/ns/net"), []).append(pid)
    found = set()
    for members in by_namespace.values():
        table: dict[str, tuple[str, int]] | None = None
        for pid in members:
            inodes = _socket_inodes(pid)
            if not inodes:
                continue
            if table is None:
                table = _listening_sockets(pid)
            found |= {Listener(pid, *table[inode]) for inode in inodes & table.keys()}
    return found
