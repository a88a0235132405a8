"""`sluice serve --data-parallel-size 2` end to end: two replicas (engine + tokenizer service each) of a tiny random
Llama behind one gateway. Requests spread over both replicas, counted by each engine (the gateway's federated
``vllm:request_success_total``, one ``engine`` label per replica); killing one replica's engine fails none of the
requests sent after it died, ``/ready`` stays 200, the supervisor restarts that engine alone, and it serves again."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import default_model_path
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.procs import ServeStack, http_status, wait_until

pytestmark = pytest.mark.slow


def consecutive_free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1 now."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n > 65535:
            continue
        with ExitStack() as held:
            try:
                for port in range(first, first + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    tmp = tmp_path_factory.mktemp("dp")
    save_tiny_llama(tmp / "tiny", vocab_size=49152)   # the default model's vocabulary, for its tokenizer
    s = ServeStack(tmp, "--model", str(tmp / "tiny"), "--tokenizer", default_model_path(), "--data-parallel-size",
                   "2", "--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--num-threads", "1",
                   "--shutdown-timeout", "2")
    base = consecutive_free_ports(6)   # 2 engines, 2 tokenizer services, 2 metrics pages
    s.engine_port, s.tokenizer_port = base, base + 2
    s.flags += ["--engine-metrics-port", str(base + 4)]
    s.start()
    yield s
    s.stop()


def completion(stack: ServeStack, i: int) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/completions", timeout=30,
                      json={"prompt": f"Request {i}:", "max_tokens": 3, "temperature": 0})


def requests_per_replica(stack: ServeStack) -> dict[str, float]:
    """Requests each engine finished, by its ``engine`` label on the gateway's /metrics."""
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                counts[sample.labels["engine"]] = counts.get(sample.labels["engine"], 0.0) + sample.value
    return counts


def engine_pids(stack: ServeStack) -> dict[int, int]:
    """Engine port -> pid of the supervisor's engine children."""
    pids = {}
    for pid in stack.child_pids():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if argv[1:3] == ["-m", "engine"]:
            pids[int(argv[argv.index("--port") + 1])] = pid
    return pids


def test_requests_spread_over_replicas_and_survive_one_dying(stack: ServeStack) -> None:
    before = requests_per_replica(stack)
    for i in range(20):
        r = completion(stack, i)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    after = requests_per_replica(stack)
    served = {engine: after.get(engine, 0.0) - before.get(engine, 0.0) for engine in ("0", "1")}
    assert sum(served.values()) == 20 and min(served.values()) >= 5, served   # in turn: 10 and 10

    pids = engine_pids(stack)
    assert sorted(pids) == [stack.engine_port, stack.engine_port + 1]
    others = sorted(set(stack.child_pids()) - {pids[stack.engine_port + 1]})
    os.kill(pids[stack.engine_port + 1], signal.SIGKILL)
    wait_until(lambda: pids[stack.engine_port + 1] not in stack.child_pids(), 5, what="engine 1 reaped")
    for i in range(10):   # at once, while replica 1 is down: the gateway routes around it
        r = completion(stack, 100 + i)
        assert r.status_code == 200, (i, r.text)
    assert http_status(f"{stack.base_url}/ready") == 200

    wait_until(lambda: stack.engine_port + 1 in engine_pids(stack), 30, what="engine 1 restarted")
    assert sorted(set(stack.child_pids()) - {engine_pids(stack)[stack.engine_port + 1]}) == others   # alone
    deadline = time.monotonic() + 120
    while requests_per_replica(stack).get("1", 0.0) == 0.0:   # the new engine's counters start at 0
        assert time.monotonic() < deadline, "replica 1 never served again"
        assert completion(stack, 200).status_code == 200
