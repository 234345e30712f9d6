"""The rendezvous store, listening on one address only.

torch's ``TCPStore`` server listens on every interface whatever host it is given
(pytorch/pytorch#173909), and it has no authentication: whoever reaches its port can read and
write the rendezvous keys and the peers' notices. So the server side binds its listening socket
here, to one address, and hands it to ``TCPStore`` (``master_listen_fd``): loopback on a run
within one host, the address the peers reach it by on a run across hosts. Every store of the
project is made through ``host_store`` / ``join_store``: the launchers and the test suite's
rank pools.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` (an IP address) only; port 0: the kernel picks one,
    atomically (no free-port race)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port after a restart
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(
    host: str,
    world_size: int | None,
    timeout_s: float,
    port: int = 0,
    wait_for_workers: bool = False,
) -> dist.TCPStore:
    """The store's server, listening on ``host:port`` only (``store.port`` is the port).

    ``world_size`` counts every client and the server's own handle, as in ``TCPStore``."""
    with listening_socket(host, port) as sock:
        # TCPStore owns the descriptor it is given (it closes it with the store); it gets a
        # duplicate so the socket object here can close its own
        return dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            wait_for_workers=wait_for_workers,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=os.dup(sock.fileno()),
        )


def join_store(host: str, port: int, world_size: int | None, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``host:port``; waits up to ``timeout_s`` for the server."""
    return dist.TCPStore(
        host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
