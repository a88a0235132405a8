"""Request migration end to end: `sluice serve -dp 2 -tp 2` (two replicas of a tiny random Llama, each engine with a
second tensor-parallel rank in a process of its own). 12 greedy and 4 seeded sampled streams of 120 tokens, and one
seeded stream with n = 2, run undisturbed, then again while one replica dies mid-stream — its engine (the one the n = 2
stream runs on, so that its sequences move as n = 1 requests) SIGKILLed, then (once it is back) the other replica's
rank 1 SIGKILLed. Every stream ends with all its tokens, text byte-identical to the undisturbed run's, one
finish reason per sequence and the same usage; the tokenizer services counted the moves
(``sluice:requests_migrated_total``, read from the gateway's /metrics), and the replica that took them ends with
every KV block free. float32: in bfloat16 a recomputed prefill may round differently from the decoded KV
(docs/serving.md#request-migration)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.procs import grpc_serving
from engine.config import default_model_path
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc
from services.replicas import consecutive_free_ports
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.procs import ServeStack, wait_until

pytestmark = pytest.mark.slow

TOKENS = 120
GREEDY, SEEDED = 12, 4
PAIR = GREEDY + SEEDED   # the n = 2 stream's number


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    tmp = tmp_path_factory.mktemp("migration")
    save_tiny_llama(tmp / "tiny", vocab_size=49152)   # the default model's vocabulary, for its tokenizer
    s = ServeStack(tmp, "--model", str(tmp / "tiny"), "--tokenizer", default_model_path(), "--data-parallel-size",
                   "2", "--tensor-parallel-size", "2", "--kv-cache-memory", "32MiB", "--max-num-seqs", "16",
                   "--num-threads", "1", "--shutdown-timeout", "60", "--routing", "round_robin", "--dtype", "float32",
                   "--enable-log-requests")   # the tokenizer services name the engine each request went to
    base = consecutive_free_ports(6)   # 2 engines, 2 tokenizer services, the engines' metrics pages
    s.engine_port, s.tokenizer_port = base, base + 2
    s.flags += ["--engine-metrics-port", str(base + 4)]   # the tokenizer services' pages: free ports (the default)
    s.start()
    yield s
    s.stop()


@dataclass
class Stream:
    texts: dict[int, str] = field(default_factory=dict)   # by choice index
    events: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    usage: dict[str, int] | None = None
    errors: list[str] = field(default_factory=list)


def body(i: int) -> dict[str, object]:
    sampling = {"temperature": 0} if i < GREEDY else {"temperature": 1.0, "top_p": 0.9, "seed": 1000 + i}
    return {"prompt": f"Story {i}:", "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "n": 2 if i == PAIR else 1, **sampling}


def run_streams(stack: ServeStack, tag: str, during: threading.Event | None = None, count: int = PAIR + 1
                ) -> list[Stream]:
    """The first ``count`` of the 17 streams at once, request ids ``{tag}-{i}``; ``during`` is set once each has
    delivered 15 tokens and none has ended."""
    streams = [Stream() for _ in range(count)]

    def read(i: int) -> None:
        s = streams[i]
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body(i), timeout=120,
                          headers={"x-request-id": f"{tag}-{i}"}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.errors.append(line)
                    continue
                for choice in chunk["choices"]:
                    s.texts[choice["index"]] = s.texts.get(choice["index"], "") + choice["text"]
                    s.events += 1
                    if choice["finish_reason"] is not None:
                        s.finish_reasons.append(choice["finish_reason"])
                if chunk.get("usage"):
                    s.usage = chunk["usage"]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    if during is not None:
        wait_until(lambda: all(s.events >= 15 for s in streams), 120, what="every stream under way")
        assert not any(s.finish_reasons for s in streams)
        during.set()
    for t in threads:
        t.join(180)
    return streams


def engine_pid(stack: ServeStack, port: int) -> int:
    for pid in stack.child_pids():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if argv[1:3] == ["-m", "engine"] and argv[argv.index("--port") + 1] == str(port):
            return pid
    raise LookupError(f"no engine on port {port}")


def rank_pids(engine: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(engine)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()
            if b"engine.executor.worker_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def migrated(stack: ServeStack) -> float:
    """``sluice:requests_migrated_total`` of both tokenizer services, as the gateway's /metrics federates them."""
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as r:
        samples = [s for family in text_string_to_metric_families(r.read().decode()) for s in family.samples
                   if s.name == "sluice:requests_migrated_total"]
    assert sorted(tuple(s.labels.items()) for s in samples) == [(("tokenizer", "0"),), (("tokenizer", "1"),)], samples
    return sum(s.value for s in samples)


def idle_info(port: int) -> engine_pb2.GetInfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        deadline = time.monotonic() + 15
        while True:
            info = stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=5)
            if (info.num_running == info.num_waiting == 0 and info.free_kv_blocks == info.total_kv_blocks) \
                    or time.monotonic() > deadline:
                return info
            time.sleep(0.1)


def assert_same_as(streams: list[Stream], reference: list[Stream]) -> None:
    for i, (s, ref) in enumerate(zip(streams, reference, strict=True)):
        n = 2 if i == PAIR else 1
        assert not s.errors, (i, s.errors)
        assert s.finish_reasons == ["length"] * n, (i, s.finish_reasons)
        assert s.usage is not None and s.usage["completion_tokens"] == n * TOKENS, (i, s.usage)
        assert s.usage["prompt_tokens"] == ref.usage["prompt_tokens"], i   # type: ignore[index]
        assert sorted(s.texts) == list(range(n)), (i, sorted(s.texts))
        assert {k: t.encode() for k, t in s.texts.items()} == {k: t.encode() for k, t in ref.texts.items()}, i


def engine_port_of(stack: ServeStack, request_id: str) -> int:
    """The engine port a tokenizer service sent request ``request_id`` to (its log line on receiving it)."""
    found = re.findall(rf"Received request {re.escape(request_id)} .*; to the engine at 127\.0\.0\.1:(\d+)",
                       stack.log.read_text(errors="replace"))
    assert len(found) == 1, found
    return int(found[0])


def kill_mid_stream(stack: ServeStack, tag: str, victim: Callable[[], int]) -> list[Stream]:
    """Run the streams and SIGKILL process ``victim()`` once they are all under way."""
    under_way = threading.Event()
    failed: list[BaseException] = []

    def kill() -> None:
        under_way.wait(120)
        try:
            os.kill(victim(), signal.SIGKILL)
        except BaseException as e:   # noqa: BLE001 - raised below, in the test's thread
            failed.append(e)

    killer = threading.Thread(target=kill)
    killer.start()
    streams = run_streams(stack, tag, under_way)
    killer.join()
    if failed:
        raise failed[0]
    return streams


def test_streams_survive_an_engine_then_a_tensor_parallel_rank_dying(stack: ServeStack) -> None:
    reference = run_streams(stack, "reference")
    for i, ref in enumerate(reference):
        assert not ref.errors and ref.finish_reasons == ["length"] * (2 if i == PAIR else 1) and ref.usage is not None
    assert len({ref.texts[0] for ref in reference}) > 1 and reference[PAIR].texts[0] != reference[PAIR].texts[1]

    # The engine of the replica the n = 2 stream runs on dies: its streams move to the other replica.
    ports: list[int] = []

    def pair_engine() -> int:
        ports.append(engine_port_of(stack, f"first-{PAIR}"))
        return engine_pid(stack, ports[0])

    streams = kill_mid_stream(stack, "first", pair_engine)
    assert_same_as(streams, reference)
    assert re.search(rf"request first-{PAIR} moved from the engine at 127\.0\.0\.1:{ports[0]} to .* after "
                     r"(?!0 )\d+ delivered tokens", stack.log.read_text(errors="replace"))
    moved = migrated(stack)
    assert 1 <= moved <= PAIR + 1
    dead, survivor = ports[0], 2 * stack.engine_port + 1 - ports[0]
    info = idle_info(survivor)
    assert info.free_kv_blocks == info.total_kv_blocks and info.total_kv_blocks > 0

    # The dead replica restarted; now rank 1 of the other dies, which ends that replica: its streams move back.
    wait_until(lambda: grpc_serving(f"127.0.0.1:{dead}", "sluice.v1.Engine"), 120, what="the replica restarted")
    time.sleep(1.5)   # the tokenizer services see it up (GetInfo each second)
    ranks = rank_pids(engine_pid(stack, survivor))
    assert len(ranks) == 1
    streams = kill_mid_stream(stack, "second", lambda: ranks[0])
    assert_same_as(streams, reference)
    assert migrated(stack) > moved
    info = idle_info(dead)
    assert info.free_kv_blocks == info.total_kv_blocks


def test_sigterm_with_streams_running_lets_every_one_finish_and_exits_zero(stack: ServeStack) -> None:
    """Issue 44's drain (acceptance 4), last in the module: SIGTERM to `sluice serve` while 8 greedy streams run
    (each 15 tokens in; on whichever replica is up — the one whose rank died above may still be restarting):
    every one still ends with all its tokens and one finish reason, and the supervisor exits 0 once they have."""
    assert stack.proc is not None
    under_way = threading.Event()
    signalled: list[float] = []

    def terminate() -> None:
        under_way.wait(120)
        stack.proc.send_signal(signal.SIGTERM)   # type: ignore[union-attr]
        signalled.append(time.monotonic())

    killer = threading.Thread(target=terminate)
    killer.start()
    streams = run_streams(stack, "drain", under_way, count=8)
    killer.join()
    assert signalled
    for i, s in enumerate(streams):
        n = 1
        assert not s.errors, (i, s.errors)
        assert s.finish_reasons == ["length"] * n and sorted(s.texts) == list(range(n)), (i, s.finish_reasons)
        assert s.usage is not None and s.usage["completion_tokens"] == n * TOKENS, (i, s.usage)
    assert stack.proc.wait(60) == 0
