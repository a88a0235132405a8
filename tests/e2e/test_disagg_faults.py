"""Prefill/decode disaggregation with two prefill engines and one decode engine (`sluice serve --prefill-replicas 2
--decode-replicas 1`) on the default model (SmolLM2-135M, float32), through the official openai SDK, and its
faults. Greedy outputs equal the colocated ones (a tokenizer service of the test's own in front of one prefill
engine alone) with the decode engine pulling exactly the prompts' full blocks, from both prefill engines. Then: every
pull dropped (fault injected in the transport: the decode engine computes the prompts itself, counted, the outputs
unchanged); a client gone during the handoff; a prefill engine SIGKILLed with requests on it (they are sent to the
other once and complete identically). Each request ends with exactly one finish reason, and afterwards every KV
block of every engine is free."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.procs import grpc_serving
from engine.worker.kv_pull import FAULT_ENV
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.replicas import consecutive_free_ports
from tests.procs import ServeStack, tokenizer_process, wait_until

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_TOKENS = 12
TOPICS = ["rivers", "mountains", "harbours", "forests", "deserts", "glaciers", "islands", "canyons", "meadows", "caves"]


def prompt(i: int) -> str:
    """Prompt i: its topic first (no two share a first block), then 0 to ~230 words."""
    filler = " ".join(f"and the {TOPICS[(i + k) % len(TOPICS)]} of the north" for k in range((i * 7) % 41))
    return f"Write about {TOPICS[i % len(TOPICS)]} number {i}. {filler}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    tmp = tmp_path_factory.mktemp("disagg-faults")
    drop = tmp / "drop"
    s = ServeStack(tmp, "--prefill-replicas", "2", "--decode-replicas", "1", "--dtype", "float32",
                   "--kv-cache-memory", "128MiB", "--max-num-seqs", "8", "--num-threads", "1",
                   # prompts prefill over several steps: a request stays on its prefill engine long enough for the
                   # kill test to find it there (GetInfo answers between steps)
                   "--max-num-batched-tokens", "32",
                   "--block-size", str(BLOCK), "--shutdown-timeout", "5")
    # 3 engines (prefill first), 3 tokenizer services; the metrics pages take free ports of their own (a range
    # reserved here but not yet bound could be handed to one of them)
    base = consecutive_free_ports(6)
    s.engine_port, s.tokenizer_port = base, base + 3
    saved = os.environ.get(FAULT_ENV)
    os.environ[FAULT_ENV] = f"drop-while:{drop}"   # the engines inherit it; pulls fail while the file exists
    try:
        s.start()
    finally:
        if saved is None:
            del os.environ[FAULT_ENV]
        else:
            os.environ[FAULT_ENV] = saved
    s.drop = drop   # type: ignore[attr-defined]
    yield s
    s.stop()


def engine_info(port: int) -> engine_pb2.GetInfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)


def metrics(stack: ServeStack) -> dict[tuple[str, str, str], float]:
    """The gateway's federated ``sluice:kv_transfer_*_total`` samples by (name, kv_role, direction), summed."""
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    out: dict[tuple[str, str, str], float] = {}
    for f in families:
        for s in f.samples:
            if s.name.startswith("sluice:kv_transfer_") and s.name.endswith("_total"):
                key = (s.name, s.labels.get("kv_role", ""), s.labels.get("direction", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def sent_by_engine(stack: ServeStack) -> dict[str, float]:
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as r:
        families = list(text_string_to_metric_families(r.read().decode()))
    return {s.labels["engine"]: s.value for f in families for s in f.samples
            if s.name == "sluice:kv_transfer_blocks_total" and s.labels.get("direction") == "sent"
            and s.labels.get("kv_role") == "kv_producer"}


def all_free(stack: ServeStack) -> None:
    def idle(port: int) -> bool:
        try:
            info = engine_info(port)
        except grpc.RpcError:
            return False   # (a restarting engine)
        return info.num_running == info.num_waiting == 0 and info.free_kv_blocks == info.total_kv_blocks

    for port in range(stack.engine_port, stack.engine_port + 3):
        wait_until(lambda p=port: idle(p), 60, what=f"every KV block free on the engine at {port}")


@pytest.fixture(scope="module")
def expected(stack: ServeStack) -> list[str]:
    """Each prompt's greedy text from the first prefill engine alone, as a colocated engine runs it; its prefix
    cache is emptied afterwards."""
    producer = f"127.0.0.1:{stack.engine_port}"
    with tokenizer_process(stack.log.parent, producer, "--served-model-name", "colocated") as addr, \
            grpc.insecure_channel(addr) as channel:
        wait_until(lambda: grpc_serving(addr, "sluice.v1.Generation"), 30, what="colocated service")
        stub = generation_pb2_grpc.GenerationStub(channel)
        texts = ["".join(r.text for r in stub.Generate(generation_pb2.GenerateRequest(
            text=prompt(i), sampling=common_pb2.SamplingParameters(temperature=0.0),
            stopping=generation_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=120))
            for i in range(len(TOPICS))]
    with grpc.insecure_channel(producer) as channel:
        reset = engine_pb2_grpc.EngineStub(channel).ResetPrefixCache(common_pb2.ResetPrefixCacheRequest(), timeout=10)
    assert reset.ok
    return texts


def client(stack: ServeStack) -> tuple[openai.OpenAI, str]:
    c = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=180)
    return c, c.models.list().data[0].id


def complete(stack: ServeStack, i: int, *, salt: str, model: str | None = None) -> tuple[str, int, list[str]]:
    """Prompt i streamed (``salt``: a cache salt, so that no earlier run's blocks are cached on the decode
    engine): its text, prompt tokens, and every finish reason it got. ``model``: the served name (else asked)."""
    c, asked = client(stack) if model is None else (openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused",
                                                                  max_retries=0, timeout=180), model)
    model = asked
    text, reasons, tokens = "", [], 0
    for chunk in c.completions.create(model=model, prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0,
                                      stream=True, stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True, "cache_salt": salt}):
        for choice in chunk.choices:
            text += choice.text
            reasons += [choice.finish_reason] if choice.finish_reason else []
        if chunk.usage is not None:
            tokens = chunk.usage.prompt_tokens
    return text, tokens, reasons


def test_two_prefill_engines_hand_their_blocks_to_the_decode_engine(stack: ServeStack, expected: list[str]) -> None:
    before = metrics(stack)
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        runs = list(pool.map(lambda i: complete(stack, i, salt="first"), range(len(TOPICS))))
    assert [text for text, _, _ in runs] == expected
    assert all(reasons == ["length"] for _, _, reasons in runs)
    all_free(stack)
    after = metrics(stack)
    full_blocks = sum(tokens // BLOCK for _, tokens, _ in runs)
    received = ("sluice:kv_transfer_blocks_total", "kv_consumer", "received")
    assert after[received] - before.get(received, 0) == full_blocks > 20
    sent = ("sluice:kv_transfer_blocks_total", "kv_producer", "sent")
    assert after[sent] - before.get(sent, 0) == full_blocks
    assert after[("sluice:kv_transfer_fallbacks_total", "kv_consumer", "")] == 0
    assert all(v > 0 for v in sent_by_engine(stack).values()) and len(sent_by_engine(stack)) == 2


def test_dropped_transfers_are_recomputed_with_the_same_output(stack: ServeStack, expected: list[str]) -> None:
    drop: Path = stack.drop   # type: ignore[attr-defined]
    before = metrics(stack)
    drop.touch()
    try:
        runs = [complete(stack, i, salt="dropped") for i in (3, 7)]
    finally:
        drop.unlink()
    assert [text for text, _, _ in runs] == [expected[3], expected[7]]
    assert all(reasons == ["length"] for _, _, reasons in runs)
    after = metrics(stack)
    fallbacks = ("sluice:kv_transfer_fallbacks_total", "kv_consumer", "")
    assert after[fallbacks] - before.get(fallbacks, 0) == 2
    received = ("sluice:kv_transfer_blocks_total", "kv_consumer", "received")
    assert after[received] == before[received]
    all_free(stack)


def test_a_client_gone_during_the_handoff_leaves_no_block_held(stack: ServeStack) -> None:
    c, model = client(stack)
    for i in (2, 6, 9):
        chunks = c.completions.create(model=model, prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True, "cache_salt": "gone"})
        next(iter(chunks))   # the first token: the request is being handed to the decode engine now
        chunks.close()
    all_free(stack)


def test_a_prefill_engine_killed_mid_request_sends_its_requests_to_the_other(stack: ServeStack,
                                                                              expected: list[str]) -> None:
    victim_port = stack.engine_port

    def victim() -> int | None:
        for pid in stack.child_pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:   # (a child that just exited)
                continue
            if argv[1:3] == ["-m", "engine"] and argv[argv.index("--port") + 1] == str(victim_port):
                return pid
        return None   # (between its death and its restart)

    pid = victim()
    assert pid is not None
    killed = threading.Event()

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                info = engine_info(victim_port)
            except grpc.RpcError:
                return
            if info.num_running + info.num_waiting:
                os.kill(pid, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.005)

    _, model = client(stack)   # asked before the kill: only the requests in flight are under test
    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        runs = list(pool.map(lambda i: complete(stack, i, salt="killed", model=model), range(len(TOPICS))))
    killer.join()
    assert killed.is_set(), "the prefill engine never had a request to be killed with"
    assert [text for text, _, _ in runs] == expected
    assert all(reasons == ["length"] for _, _, reasons in runs)   # one finish reason each
    wait_until(lambda: victim() not in (None, pid), 120, what="the killed prefill engine restarted")
    all_free(stack)
