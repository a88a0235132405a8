"""Real processes on 127.0.0.1 for the service tests: start, wait until ready, stop."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc

from common.procs import free_port, grpc_serving, stop_process
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def wait_until(check: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes] | None = None,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        if check():
            return
        time.sleep(0.05)  # a check is a local call of ~1 ms; a slower poll adds its half-interval to every start
    raise TimeoutError(f"{what} not reached in {timeout}s")


def spawn(args: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env)


def python_outputs(*runs: tuple[list[str], dict[str, str | None]], timeout: float = 120) -> list[str]:
    """The stripped stdout of ``python *args`` for each run's ``(args, env)``, each in a fresh process of this
    environment with ``env`` set (removed where None), in ROOT. Started together: a test that checks a fresh
    process's state in several settings waits for the slowest import of torch, not for their sum."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for args, env in runs:
            full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
            procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=full))
        outs = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr
            outs.append(stdout.strip())
        return outs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> int:
    code = stop_process(proc, timeout)
    assert code is not None
    return code


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
def tokenizer_processes(tmp: Path, engine_addr: str, *flag_sets: Sequence[str]) -> Iterator[list[str]]:
    """Tokenizer services in front of ``engine_addr``, one per set of flags, started together; their addresses."""
    ports: list[int] = []
    while len(ports) < len(flag_sets):  # chosen before any of them binds: distinct
        if (port := free_port()) not in ports:
            ports.append(port)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port, flags in zip(ports, flag_sets, strict=True):
            procs.append(spawn(["-m", "services.tokenizer", "--engine", engine_addr, "--port", str(port), *flags],
                               tmp / f"tokenizer-{port}.log"))
        addrs = [f"127.0.0.1:{port}" for port in ports]
        for proc, addr in zip(procs, addrs, strict=True):
            wait_until(lambda a=addr: grpc_serving(a, "sluice.v1.Generation"), 120, proc, "tokenizer ready")
        yield addrs
    finally:
        for proc in procs:
            stop(proc)


@contextmanager
def tokenizer_process(tmp: Path, engine_addr: str, *flags: str) -> Iterator[str]:
    with tokenizer_processes(tmp, engine_addr, flags) as (addr,):
        yield addr


def http_status(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


class ServeStack:
    """``sluice serve`` as a real process tree; ports are chosen free."""

    def __init__(self, tmp: Path, *flags: str, ssl_context: ssl.SSLContext | None = None, cwd: Path = ROOT) -> None:
        """``ssl_context``: the gateways serve HTTPS (flags with --ssl-certfile), verified with it; ``cwd``: where
        ``sluice serve`` runs (relative model paths are read from there)."""
        self.ssl_context = ssl_context
        self.cwd = cwd
        self.port = free_port()
        self.engine_port = free_port()
        self.tokenizer_port = free_port()
        while self.tokenizer_port + 1 in (self.port, self.engine_port):
            self.tokenizer_port = free_port()
        self.flags = list(flags)
        self.log = tmp / f"serve-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"{'http' if self.ssl_context is None else 'https'}://127.0.0.1:{self.port}"

    @property
    def engine_addr(self) -> str:
        return f"127.0.0.1:{self.engine_port}"

    def start(self, timeout: float = 300) -> ServeStack:
        """Started, and ready: /ready answers 200 (the gateway comes up with the other children and answers 503
        until the engine behind it has loaded the model)."""
        self.proc = spawn(["-m", "services.cli", "serve", "--port", str(self.port), "--engine-port",
                           str(self.engine_port), "--tokenizer-port", str(self.tokenizer_port), *self.flags],
                          self.log, self.cwd)
        wait_until(lambda: http_status(f"{self.base_url}/ready", context=self.ssl_context) == 200, timeout,
                   self.proc, "sluice serve ready")
        return self

    def engine_idle(self, timeout: float = 15) -> engine_pb2.GetInfoResponse:
        """The engine's GetInfo once nothing runs or waits and every KV block is free (or at ``timeout``)."""
        stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(self.engine_addr))
        deadline = time.monotonic() + timeout
        while True:
            info = stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=5)
            if (info.num_running == 0 and info.num_waiting == 0 and info.free_kv_blocks == info.total_kv_blocks) \
                    or time.monotonic() > deadline:
                return info
            time.sleep(0.05)

    def child_pids(self) -> list[int]:
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def engine_pid(self) -> int:
        for pid in self.child_pids():
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"engine" in cmd and b"-m" in cmd and cmd[cmd.index(b"-m") + 1] == b"engine":
                return pid
        raise LookupError("no engine child")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        return stop(self.proc, timeout=30)
