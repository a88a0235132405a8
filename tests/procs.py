"""Real processes on 127.0.0.1 for the service tests: start, wait until ready, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def grpc_serving(addr: str, service: str = "") -> bool:
    try:
        with grpc.insecure_channel(addr) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_until(check: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes] | None = None,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not reached in {timeout}s")


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextmanager
def engine_process(tmp: Path, *flags: str) -> Iterator[str]:
    port = free_port()
    proc = spawn(["-m", "engine", "--port", str(port), *flags], tmp / f"engine-{port}.log")
    addr = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: grpc_serving(addr, "sluice.v1.Engine"), 300, proc, "engine ready")
        yield addr
    finally:
        stop(proc)


@contextmanager
def tokenizer_process(tmp: Path, engine_addr: str, *flags: str) -> Iterator[str]:
    port = free_port()
    proc = spawn(["-m", "services.tokenizer", "--engine", engine_addr, "--port", str(port), *flags],
                 tmp / f"tokenizer-{port}.log")
    addr = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: grpc_serving(addr, "sluice.v1.Generation"), 120, proc, "tokenizer ready")
        yield addr
    finally:
        stop(proc)
