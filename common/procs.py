"""Process helpers: children of ``sluice serve`` end with it, free ports, health probes, stopping a server.

Processes started by ``sluice serve`` end when it does, even when it is SIGKILLed (Linux PR_SET_PDEATHSIG).

The supervisor passes its pid in ``SLUICE_PARENT_PID``; each child calls :func:`die_with_parent` first thing
in ``main``. Set in the child rather than in a ``preexec_fn``: Python code between fork and exec is unsafe
in a parent that already runs threads (the supervisor's gRPC health probes start some), and without a
``preexec_fn`` ``subprocess`` can use ``vfork``/``posix_spawn``.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
from typing import TYPE_CHECKING

from common.settings import ENV_PARENT_PID, take_parent_pid

if TYPE_CHECKING:
    from common.tls import GrpcTls

__all__ = ["ENV_PARENT_PID", "die_with_parent", "free_port", "grpc_serving", "port_number", "stop_process"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask the kernel for SIGTERM when the parent named in ``SLUICE_PARENT_PID`` exits; True when armed.

    If the parent is already gone (it died between spawning us and this call), SIGTERM ourselves now.
    """
    parent = take_parent_pid()
    if parent is None:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return False
    except (OSError, AttributeError):  # not Linux / no glibc: nothing to arm
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (tests and benchmarks start their servers on it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_number(value: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0: the flag's "off" or "any free one", as it documents)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {port}")
    return port


def grpc_serving(addr: str, service: str = "", tls: GrpcTls | None = None) -> bool:
    """Whether the gRPC health service at ``addr`` reports ``service`` ("" = the whole server) SERVING; over
    TLS (presenting the client certificate under mTLS) when ``tls`` is given."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.tls import sync_channel

    try:
        with sync_channel(addr, tls) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 15.0, *, group: bool = False) -> int | None:
    """SIGTERM (to its process group with ``group``: servers that spawn workers), SIGKILL after ``grace_s``;
    returns the exit code."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()
