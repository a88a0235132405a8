"""Several gateways on one port (``sluice serve --gateways N``): each process binds its own listening socket with
``SO_REUSEPORT``, and Linux spreads new connections over the sockets of the group (by a hash of each connection's
addresses), so each gateway accepts and serves its own connections; when one exits, its socket leaves the group
and the others take every new connection. Only a process of the same user can join the group; ``port_free``,
checked before the first gateway starts, keeps a server already on the port from being joined silently. Other
systems either lack the option or do not spread connections with it (macOS, the BSDs without ``SO_REUSEPORT_LB``):
there the gateways take consecutive ports instead."""

from __future__ import annotations

import os
import socket
import sys

SUPPORTED = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def shared_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` (not yet listening: the server calls ``listen``)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def port_free(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` (a bind without ``SO_REUSEPORT`` succeeds)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (Linux: ``/proc``): with the port shared,
    an HTTP probe may be answered by any gateway, so each one's readiness is its own listening socket."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since it was listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:  # 0A: LISTEN
                return True
    return False
