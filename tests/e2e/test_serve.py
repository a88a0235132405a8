"""`sluice serve` end to end, as users run it: the official openai SDK, curl, real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from engine.config import default_model_path
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.procs import ServeStack, http_status, wait_until

pytestmark = pytest.mark.slow

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("serve"), "--dtype", "float32", "--max-num-seqs", "4",
                   "--kv-cache-memory", "512MiB", "--tokenizers", "2", "--keepalive-interval", "0.5")
    s.start()
    yield s
    s.stop()


def _client(stack: ServeStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)



def test_openai_sdk_chat_sync_and_stream(stack: ServeStack) -> None:
    client = _client(stack)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=PARIS, temperature=0, max_tokens=32)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.choices[0].finish_reason in ("stop", "length")
    tok = httpx.post(f"{stack.base_url}/tokenize", json={"model": model, "messages": PARIS}).json()
    assert resp.usage.prompt_tokens == tok["count"]
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=PARIS, temperature=0, max_tokens=32,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        resp.usage.prompt_tokens, resp.usage.completion_tokens)


def test_openai_sdk_completions_async(stack: ServeStack) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
        model = (await client.models.list()).data[0].id
        prompt = "The capital of France is"
        resp = await client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12)
        assert "Paris" in resp.choices[0].text
        tok = httpx.post(f"{stack.base_url}/tokenize", json={"model": model, "prompt": prompt}).json()
        assert resp.usage.prompt_tokens == tok["count"]
        stream = await client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12,
                                                 stream=True)
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        assert streamed == resp.choices[0].text
        await client.close()

    asyncio.run(run())


def test_openai_sdk_stream_interval_groups_tokens_and_keeps_the_text(stack: ServeStack) -> None:
    client = _client(stack)
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt="Once upon a time", temperature=0, max_tokens=10, stream=True,
              stream_options={"include_usage": True})
    one = list(client.completions.create(**kw, extra_body={"ignore_eos": True}))
    grouped = list(client.completions.create(**kw, extra_body={"ignore_eos": True, "stream_interval": 4}))
    text = ["".join(c.choices[0].text for c in chunks if c.choices) for chunks in (one, grouped)]
    assert text[0] == text[1] and text[0]
    # 10 tokens as 1 + 4 + 4 + 1: at most 4 text chunks (a chunk may hold back half a character), 10 without.
    deltas = [[c for c in chunks if c.choices and c.choices[0].text] for chunks in (one, grouped)]
    assert len(deltas[1]) <= 4 < len(deltas[0])
    assert grouped[-1].usage.completion_tokens == one[-1].usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kw, extra_body={"stream_interval": 0})
    assert err.value.body["param"] == "stream_interval"


def _curl_stream(stack: ServeStack, body: dict) -> list[str]:
    out = subprocess.run(["curl", "-sN", "-X", "POST", f"{stack.base_url}/v1/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split("\n")


def test_curl_sees_sse_framing_and_keepalives_while_queued(stack: ServeStack) -> None:
    client = _client(stack)
    model = client.models.list().data[0].id
    stop_flag = threading.Event()

    def occupy() -> None:
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=60,
                          json={"model": model, "prompt": "Go on and on:", "max_tokens": 300, "ignore_eos": True,
                                "stream": True}) as r:
            for _ in r.iter_lines():
                if stop_flag.is_set():
                    break

    busy = [threading.Thread(target=occupy) for _ in range(4)]  # all 4 running slots
    for t in busy:
        t.start()
    engine = engine_pb2_grpc.EngineStub(grpc.insecure_channel(stack.engine_addr))
    wait_until(lambda: engine.GetInfo(engine_pb2.GetInfoRequest(), timeout=5).num_running == 4, 60,
               what="all 4 running slots taken")
    try:
        lines = _curl_stream(stack, {"model": model, "prompt": "Hello", "max_tokens": 5, "stream": True})
    finally:
        stop_flag.set()
        for t in busy:
            t.join(30)
    events = [ln for ln in lines if ln]
    assert all(ln.startswith("data: ") or ln.startswith(":") for ln in events), events
    first_data = next(i for i, ln in enumerate(events) if ln.startswith("data: "))
    assert any(ln.startswith(":") for ln in events[:first_data]), "keep-alive comments while queued"
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(ln[6:]) for ln in events if ln.startswith("data: {")]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    stack.engine_idle()


def test_64_streams_with_random_disconnects_free_everything(stack: ServeStack) -> None:
    model = _client(stack).models.list().data[0].id
    rng = random.Random(4)
    plan = [rng.randrange(1, 10) if i % 3 == 0 else None for i in range(64)]  # a third disconnect

    async def one(i: int, http: httpx.AsyncClient) -> tuple[int, int, bool]:
        body = {"model": model, "prompt": f"Item {i}: describe a colour.", "max_tokens": 12, "ignore_eos": True,
                "stream": True}
        finishes, done, seen = 0, False, 0
        async with http.stream("POST", f"{stack.base_url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                seen += 1
                finishes += json.loads(line[6:])["choices"][0]["finish_reason"] is not None
                if plan[i] is not None and seen >= plan[i]:
                    return i, finishes, done  # disconnect mid-stream
        return i, finishes, done

    async def run() -> list[tuple[int, int, bool]]:
        async with httpx.AsyncClient(timeout=180) as http:
            return await asyncio.gather(*(one(i, http) for i in range(64)))

    for i, finishes, done in asyncio.run(run()):
        if plan[i] is None:
            assert (finishes, done) == (1, True), i  # exactly one terminal event, then [DONE]
        else:
            assert finishes <= 1
    info = stack.engine_idle()
    assert info.free_kv_blocks == info.total_kv_blocks and info.num_running == 0 and info.num_waiting == 0


# The small stack asks for a key, given in a file (sluice serve hands its children a file of its own).
KEY = "sk-e2e-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    tmp = tmp_path_factory.mktemp("serve-small")
    (tmp / "keys").write_text(f"{KEY}\n")
    s = ServeStack(tmp, "--dtype", "float32", "--max-num-seqs", "2", "--api-key-file", str(tmp / "keys"),
                   "--max-queued-requests", "2", "--kv-cache-memory", "256MiB", "--shutdown-timeout", "3",
                   "--max-request-migrations", "0")   # a killed engine's streams fail (test_migration.py: they move)
    s.start()
    yield s
    s.stop()


def test_overload_gets_fast_429_with_retry_after(small_stack: ServeStack) -> None:
    url = f"{small_stack.base_url}/v1/completions"

    async def one(i: int, http: httpx.AsyncClient) -> tuple[int, float, httpx.Response]:
        t0 = time.monotonic()
        r = await http.post(url, json={"prompt": f"Burst {i}", "max_tokens": 24, "ignore_eos": True}, headers=AUTH)
        return r.status_code, time.monotonic() - t0, r

    async def run() -> list[tuple[int, float, httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(i, http) for i in range(16)))

    results = asyncio.run(run())
    codes = [c for c, _, _ in results]
    assert set(codes) <= {200, 429, 503}, codes
    rejected = [(t, r) for c, t, r in results if c != 200]
    assert rejected and codes.count(200) >= 2  # at least the queue's 2 places
    for took, r in rejected:
        assert r.headers.get("retry-after")
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
        assert took < 5.0
    for c, _, r in results:
        if c == 200:
            assert r.json()["usage"]["completion_tokens"] == 24


def test_the_key_guards_rest_and_the_tokenizers_grpc_and_no_path_or_key_shows(small_stack: ServeStack) -> None:
    """One key for the stack: REST and the tokenizer service's public gRPC API ask for it, the gateway passes
    it on (the completion goes through), no child has it on its command line, and neither API tells the
    model's filesystem path."""
    url = f"{small_stack.base_url}/v1/completions"
    body = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, timeout=60, headers=AUTH).status_code == 200
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{small_stack.tokenizer_port}"))
    request = generation_pb2.GenerateRequest(text="Hi", stopping=generation_pb2.StoppingCriteria(max_tokens=2))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "missing API key" in (err.value.details() or "")
    assert sum(len(r.token_ids) for r in stub.Generate(request, timeout=60, metadata=(("authorization",
                                                                                       f"Bearer {KEY}"),))) == 2
    for pid in [small_stack.proc.pid, *small_stack.child_pids()]:  # type: ignore[union-attr]
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    model_dir = str(Path(default_model_path()).parent)
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10, metadata=(("authorization",
                                                                                         f"Bearer {KEY}"),))
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert model_dir.encode() not in info.SerializeToString()
    models = httpx.get(f"{small_stack.base_url}/v1/models", headers=AUTH, timeout=10)
    assert models.status_code == 200 and model_dir not in models.text
    assert [m["id"] for m in models.json()["data"]] == ["SmolLM2-135M-Instruct"]


def test_engine_killed_mid_stream_then_restarted(small_stack: ServeStack) -> None:
    url = f"{small_stack.base_url}/v1/completions"
    events: list[str] = []
    ended_at: list[float] = []

    def stream() -> None:
        with httpx.stream("POST", url, timeout=60, headers=AUTH, json={"prompt": "Long story:", "max_tokens": 400,
                                                                       "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
        ended_at.append(time.monotonic())

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: len(events) >= 2, 60, what="stream started")
    killed_at = time.monotonic()
    os.kill(small_stack.engine_pid(), signal.SIGKILL)
    t.join(10)
    assert ended_at and ended_at[0] - killed_at < 2.0
    errors = [e for e in events if e.startswith("data: {") and "error" in json.loads(e[6:])]
    assert errors, events[-3:]
    wait_until(lambda: http_status(f"{small_stack.base_url}/ready") == 503, 2, what="/ready fails while down")
    wait_until(lambda: http_status(f"{small_stack.base_url}/ready") == 200, 300, what="engine restarted")
    r = httpx.post(url, json={"prompt": "Back again", "max_tokens": 4}, timeout=60, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_sigterm_drains_and_exits_zero(small_stack: ServeStack) -> None:
    assert small_stack.proc is not None
    children = small_stack.child_pids()
    assert len(children) == 3
    key_files = set()
    for pid in children:  # the gateway and the tokenizer read the supervisor's copy of the keys
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "--api-key-file" in argv:
            key_files.add(argv[argv.index("--api-key-file") + 1])
    assert len(key_files) == 1
    key_file = Path(key_files.pop())
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.read_text() == f"{KEY}\n"
    t0 = time.monotonic()
    small_stack.proc.send_signal(signal.SIGTERM)
    code = small_stack.proc.wait(3 + 2 + 3)
    assert code == 0
    assert time.monotonic() - t0 <= 3 + 2
    assert not key_file.exists()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or b"zombie" in Path(f"/proc/{pid}/status").read_bytes().lower()


def test_mindie_config_with_world_size_2_serves_tensor_parallel(tmp_path: Path) -> None:
    """A MindIE config.json as is, worldSize 2 on a tiny random Llama (4 heads, 2 KV heads): the engine runs
    tensor parallel over two processes on the CPU (--device cpu wins over the NPUs the file names), serves its
    settings (name, lengths, block size), and its greedy tokens are transformers' own. Killing rank 1 turns
    /ready 503 at once; the supervisor restarts the replica, which answers the same; no rank outlives the stack."""
    import torch

    from tests.engine.core.tiny_llama import save_tiny_llama

    reference = save_tiny_llama(tmp_path / "tiny", vocab_size=49152)   # the default model's tokenizer's vocabulary
    cfg = {
        "Version": "1.0.0",
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 1025, "maxLinkNum": 300, "httpsEnabled": False},
        "BackendConfig": {
            "backendName": "mindieservice_llm_engine", "npuDeviceIds": [[0, 1]],
            "ModelDeployConfig": {"maxSeqLen": 200, "maxInputTokenLen": 199, "truncation": False,
                                  "ModelConfig": [{"modelInstanceType": "Standard", "modelName": "tiny-mindie",
                                                   "modelWeightPath": str(tmp_path / "tiny"), "worldSize": 2,
                                                   "cpuMemSize": 5, "npuMemSize": -1, "backendType": "atb"}]},
            "ScheduleConfig": {"templateType": "Standard", "cacheBlockSize": 32, "maxPrefillBatchSize": 50,
                               "maxPrefillTokens": 2048, "maxBatchSize": 8, "maxIterTimes": 512},
        },
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    s = ServeStack(tmp_path, "--config", str(path), "--device", "cpu", "--tokenizer", default_model_path(),
                   "--kv-cache-memory", "64MiB", "--dtype", "float32")
    s.flags += ["--host", "127.0.0.1"]  # explicit flags override the file (its port 1025 too: --port is given)
    s.start()
    try:
        models = httpx.get(f"{s.base_url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny-mindie"]
        assert models[0]["max_model_len"] == 200
        stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(s.engine_addr))
        info = stub.GetInfo(engine_pb2.GetInfoRequest())
        assert (info.max_model_len, info.block_size) == (200, 32)
        engine = s.engine_pid()
        ranks = [p for p in subprocess.run(["pgrep", "-P", str(engine)], capture_output=True, text=True).stdout.split()
                 if b"python" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert ranks   # rank 1 in a process of its own (rank 0 runs in the engine process)
        prompt = [1, 504, 3303, 282, 1345, 17]
        req = engine_pb2.EngineGenerateRequest(request_id="tp", sampling=common_pb2.SamplingParameters(temperature=0),
                                               stopping=engine_pb2.EngineStoppingCriteria(max_tokens=12,
                                                                                          ignore_eos=True))
        req.prompt_token_ids.ids.extend(prompt)
        got = [t for msg in stub.Generate(req, timeout=60) for t in msg.token_ids]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(12):
                ids = torch.cat([ids, reference(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert got == ids[0, len(prompt):].tolist()

        # A rank that dies takes the replica down at once (/ready 503), and the supervisor brings it back.
        os.kill(int(ranks[0]), signal.SIGKILL)
        wait_until(lambda: http_status(f"{s.base_url}/ready") == 503, 2, what="/ready fails with a rank dead")
        wait_until(lambda: http_status(f"{s.base_url}/ready") == 200, 180, what="the replica restarted")
        restarted = s.engine_pid()
        assert restarted != engine
        ranks += [p for p in subprocess.run(["pgrep", "-P", str(restarted)], capture_output=True,
                                            text=True).stdout.split()]
        stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(s.engine_addr))
        req.request_id = "tp-again"
        assert [t for msg in stub.Generate(req, timeout=60) for t in msg.token_ids] == got
    finally:
        assert s.stop() == 0
    # No rank, of the first replica or of the restarted one, outlives sluice serve.
    left = [p for p in ranks if Path(f"/proc/{p}").exists()
            and b"zombie" not in Path(f"/proc/{p}/status").read_bytes().lower()]
    assert not left, f"ranks outlived sluice serve: {left}"


def test_children_end_when_the_supervisor_is_killed(stack: ServeStack) -> None:
    """SIGKILL leaves `sluice serve` no chance to stop its children: each armed PR_SET_PDEATHSIG itself
    (common.procs) and drains on the SIGTERM the kernel sends when the supervisor dies. It kills the module's
    stack (a stack of its own would cost ~7 s to start), so it stays the last test here to use it."""
    assert stack.proc is not None
    children = stack.child_pids()

    def gone(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status")
        return not status.exists() or b"zombie" in status.read_bytes().lower()

    try:
        assert len(children) == 4   # the engine, two tokenizer services, the gateway
        stack.proc.kill()
        stack.proc.wait(5)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(gone(pid) for pid in children):
            time.sleep(0.2)
        left = [pid for pid in children if not gone(pid)]
        assert not left, f"children outlived the supervisor: {left}"
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
