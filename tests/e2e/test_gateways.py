"""`sluice serve --gateways 2` end to end (issue 44, part 3): two gateway processes on the one port (SO_REUSEPORT),
each accepting its own connections; 64 concurrent streams from two clients all complete, spread over both; a
gateway SIGKILLed leaves the other serving every new connection, and the supervisor starts it again on the same
port. The model is a tiny random llama with the default model's tokenizer (what is measured is the gateways)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from common.reuse_port import SUPPORTED, listens_on
from engine.config import default_model_path
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.procs import ServeStack, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not SUPPORTED, reason="the gateways share a port on Linux only")]

STREAMS_PER_CLIENT = 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    tmp = tmp_path_factory.mktemp("gateways")
    save_tiny_llama(tmp / "tiny", vocab_size=49152)  # the default model's vocabulary, for its tokenizer
    config = json.loads((tmp / "tiny" / "config.json").read_text())
    (tmp / "tiny" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    s = ServeStack(tmp, "--model", str(tmp / "tiny"), "--tokenizer", default_model_path(), "--gateways", "2",
                   "--kv-cache-memory", "64MiB", "--max-num-seqs", "64", "--num-threads", "1",
                   "--shutdown-timeout", "2")
    s.start()
    yield s
    s.stop()


def gateway_pids(stack: ServeStack) -> list[int]:
    pids = []
    for pid in stack.child_pids():
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"-m" in cmd and cmd[cmd.index(b"-m") + 1] == b"gateway":
            pids.append(pid)
    return sorted(pids)


def connections(pid: int, port: int) -> int:
    """Established connections the process holds on ``port`` (the clients')."""
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


async def stream(client: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
    """(the text streamed, the finish reason)"""
    text, finish = "", None
    async with client.stream("POST", "/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 12,
                                                              "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def test_two_gateways_share_the_port_serve_64_streams_and_survive_one_killed(stack: ServeStack) -> None:
    pids = gateway_pids(stack)
    assert len(pids) == 2 and all(listens_on(pid, stack.port) for pid in pids)
    seen = {pid: 0 for pid in pids}

    async def run() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=STREAMS_PER_CLIENT)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120, limits=limits) as a, \
                httpx.AsyncClient(base_url=stack.base_url, timeout=120, limits=limits) as b:
            calls = [stream(a if i % 2 else b, i) for i in range(2 * STREAMS_PER_CLIENT)]
            tasks = [asyncio.ensure_future(c) for c in calls]
            while not all(t.done() for t in tasks):
                for pid in pids:
                    seen[pid] = max(seen[pid], connections(pid, stack.port))
                await asyncio.sleep(0.05)
            return [t.result() for t in tasks]

    results = asyncio.run(run())
    assert len(results) == 64
    for text, finish in results:
        assert finish == "length" and text
    assert all(n > 0 for n in seen.values()), seen  # each gateway accepted connections of its own
    assert sum(seen.values()) >= 32, seen

    killed, survivor = pids
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE,
               5, what="the gateway gone")
    started = time.monotonic()
    for i in range(10):  # new connections, each: every one reaches the survivor while the other is down
        r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": f"After {i}:", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    wait_until(lambda: len(gateway_pids(stack)) == 2 and all(listens_on(p, stack.port) for p in gateway_pids(stack)),
               60, what="the gateway restarted on the same port")
    restarted = (set(gateway_pids(stack)) - {survivor}).pop()
    assert restarted != killed and time.monotonic() - started < 60
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        assert client.get("/health").status_code == 200
