"""The gRPC services as real processes on 127.0.0.1: engine + two tokenizer replicas, Python and Node clients."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.procs import ROOT, engine_process, grpc_serving, tokenizer_processes, wait_until

pytestmark = pytest.mark.slow

PARIS_CHAT = [generation_pb2.ChatMessage(role="user", content="What is the capital of France?")]


KEY = "sk-grpc-stack-0123"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("grpc-stack")
    (tmp / "keys").write_text(f"other-key\n{KEY}\n")
    # fp32 so outputs are comparable across batch shapes; 4 running sequences at most so requests queue.
    with engine_process(tmp, "--dtype", "float32", "--max-num-seqs", "4", "--kv-cache-memory", "256MiB") as eng, \
            tokenizer_processes(tmp, eng, (), ("--shm-tokens", "0"), ("--api-key-file", str(tmp / "keys"))) as (
                tok_shm, tok_inline, tok_keyed):
        yield {"engine": eng, "shm": tok_shm, "inline": tok_inline, "keyed": tok_keyed}


def _gen_stub(addr: str) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))


def _eng_stub(addr: str) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(addr))


def _greedy(max_tokens: int, **kw: object) -> dict[str, object]:
    return {"sampling": common_pb2.SamplingParameters(temperature=0.0),
            "stopping": generation_pb2.StoppingCriteria(max_tokens=max_tokens, **kw)}


def _collect(stream: Iterator[generation_pb2.GenerateResponse]) -> tuple[str, list[generation_pb2.GenerateResponse]]:
    msgs = list(stream)
    return "".join(m.text for m in msgs), msgs


def _wait_idle(engine: str) -> engine_pb2.GetInfoResponse:
    stub = _eng_stub(engine)
    deadline = time.monotonic() + 10
    while True:
        info = stub.GetInfo(engine_pb2.GetInfoRequest())
        if (info.num_running == 0 and info.num_waiting == 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_python_and_node_clients_get_the_same_answer(stack: dict[str, str]) -> None:
    text, msgs = _collect(_gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=PARIS_CHAT), **_greedy(32))))
    assert "Paris" in text
    assert msgs[-1].finish_reason in (common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_LENGTH)
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
    node = shutil.which("node")
    assert node, "node is required (make test installs the client's packages)"
    body = {"chat": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
            "sampling": {"temperature": 0.0}, "stopping": {"max_tokens": 32}}
    out = subprocess.run([node, str(ROOT / "tests/node/generate.js"), stack["shm"], json.dumps(body)],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result.get("error") is None, result
    assert result["text"] == text
    assert result["usage"]["prompt_tokens"] == msgs[-1].usage.prompt_tokens


def test_node_client_asks_for_a_stream_interval_and_gets_the_same_text_in_fewer_messages(
        stack: dict[str, str]) -> None:
    text, msgs = _collect(_gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(
        text="Tell me about the sea.", **_greedy(32, ignore_eos=True))))
    assert len(msgs) >= 30  # one token per message (a message may be empty of text, never of tokens)
    body = {"text": "Tell me about the sea.", "sampling": {"temperature": 0.0},
            "stopping": {"max_tokens": 32, "ignore_eos": True}, "response": {"stream_interval": 8}}
    out = subprocess.run([shutil.which("node") or "node", str(ROOT / "tests/node/generate.js"), stack["shm"],
                          json.dumps(body)], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result.get("error") is None, result
    assert result["text"] == text and result["usage"]["completion_tokens"] == 32
    assert result["messages"] <= 1 + 32 // 8  # the first token, then groups of 8 (the last one with the finish)


def test_generate_stream_batches_a_step_for_every_request_and_matches_generate(stack: dict[str, str]) -> None:
    prompts = [f"Write a short line about the number {i}." for i in range(6)]
    serial = [_collect(_gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(
        text=p, **_greedy(16, ignore_eos=True))))[0] for p in prompts]
    starts = [generation_pb2.GenerateStreamRequest(id=i + 1, generate=generation_pb2.GenerateRequest(
        text=p, **_greedy(16, ignore_eos=True))) for i, p in enumerate(prompts)]
    messages = list(_gen_stub(stack["shm"]).GenerateStream(iter(starts), timeout=120))  # then half-closed
    texts = {i + 1: "" for i in range(len(prompts))}
    ends = {}
    for m in messages:
        for item in m.items:
            texts[item.id] += item.response.text
            if item.end:
                ends[item.id] = item.status_code
    assert [texts[i + 1] for i in range(len(prompts))] == serial
    assert ends == {i + 1: 0 for i in range(len(prompts))}
    items = sum(len(m.items) for m in messages)
    # 6 requests x 16 tokens, 4 running at once (--max-num-seqs 4): one message per engine step for all of them.
    assert len(messages) < items / 2, (len(messages), items)
    info = _wait_idle(stack["engine"])
    assert info.free_kv_blocks == info.total_kv_blocks


def test_node_client_generate_stream(stack: dict[str, str]) -> None:
    reqs = [{"text": "Tell me about the sea.", "sampling": {"temperature": 0.0},
             "stopping": {"max_tokens": 12, "ignore_eos": True}},
            {"text": "Name a colour.", "sampling": {"temperature": 0.0}, "stopping": {"max_tokens": 8}},
            {"text": "bad", "response": {"stream_interval": 0}}]
    expected = [_collect(_gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(
        text=r["text"], **_greedy(r["stopping"]["max_tokens"], ignore_eos=r["stopping"].get("ignore_eos", False)))))
        for r in reqs[:2]]
    out = subprocess.run([shutil.which("node") or "node", str(ROOT / "tests/node/generate_stream.js"), stack["shm"],
                          json.dumps(reqs)], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result.get("error") is None, result
    for i, (text, msgs) in enumerate(expected):
        got = result["requests"][str(i + 1)]
        assert got["status_code"] == 0 and got["text"] == text
        assert got["usage"]["completion_tokens"] == msgs[-1].usage.completion_tokens
        assert got["finish_reason"] == common_pb2.FinishReason.Name(msgs[-1].finish_reason)
    bad = result["requests"]["3"]
    assert (bad["status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            and "stream_interval" in bad["status_message"])
    assert bad["items"] == 1
    assert result["messages"] < result["items"]


def test_cancelled_stream_frees_blocks(stack: dict[str, str]) -> None:
    call = _gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(
        text="Tell me a long story about a dragon.", **_greedy(400, ignore_eos=True)))
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            call.cancel()
            break
    info = _wait_idle(stack["engine"])
    assert info.num_running == 0
    assert info.free_kv_blocks == info.total_kv_blocks


def test_cancelled_queued_request_is_never_scheduled(stack: dict[str, str]) -> None:
    stub = _gen_stub(stack["inline"])
    long = generation_pb2.GenerateRequest(text="Count slowly:", **_greedy(60, ignore_eos=True))
    busy = [stub.Generate(long) for _ in range(4)]  # fill the 4 running slots
    firsts = [next(iter(c)) for c in busy]
    assert all(f.token_ids for f in firsts)
    before = _eng_stub(stack["engine"]).GetInfo(engine_pb2.GetInfoRequest())
    queued = stub.Generate(generation_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[7] * 50),
                                                          **_greedy(5)))
    engine = _eng_stub(stack["engine"])
    wait_until(lambda: engine.GetInfo(engine_pb2.GetInfoRequest()).num_waiting == 1, 30, what="the request queued")
    queued.cancel()
    for c in busy:
        list(c)
    after = _wait_idle(stack["engine"])
    # prefix_cache_query_tokens grows by a request's length when it is first scheduled: the queued one never was.
    assert after.counters.prefix_cache_query_tokens == before.counters.prefix_cache_query_tokens
    assert after.free_kv_blocks == after.total_kv_blocks


def test_two_replicas_32_concurrent_streams_match_serial(stack: dict[str, str]) -> None:
    prompts = [f"Write a short line about the number {i}." for i in range(32)]
    stubs = [_gen_stub(stack["shm"]), _gen_stub(stack["inline"])]

    def run(i: int) -> str:
        req = generation_pb2.GenerateRequest(text=prompts[i], **_greedy(12, ignore_eos=True))
        return _collect(stubs[i % 2].Generate(req))[0]

    serial = [run(i) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(run, range(32)))
    assert concurrent == serial
    assert len(set(serial)) > 16


def test_shm_handoff_when_colocated_inline_otherwise(stack: dict[str, str]) -> None:
    eng = _eng_stub(stack["engine"])
    req = generation_pb2.GenerateRequest(text="The shared memory test says", **_greedy(8, ignore_eos=True))
    c0 = eng.GetInfo(engine_pb2.GetInfoRequest()).counters
    via_shm = _collect(_gen_stub(stack["shm"]).Generate(req))[0]
    c1 = eng.GetInfo(engine_pb2.GetInfoRequest()).counters
    via_inline = _collect(_gen_stub(stack["inline"]).Generate(req))[0]
    c2 = eng.GetInfo(engine_pb2.GetInfoRequest()).counters
    assert (c1.shm_handoffs - c0.shm_handoffs, c1.inline_handoffs - c0.inline_handoffs) == (1, 0)
    assert (c2.shm_handoffs - c1.shm_handoffs, c2.inline_handoffs - c1.inline_handoffs) == (0, 1)
    assert via_shm == via_inline and via_shm
    # A segment the engine cannot open is refused, which is what sends a tokenizer to inline ids.
    r = eng.RegisterSharedMemory(engine_pb2.RegisterSharedMemoryRequest(segment="sluice-no-such-seg",
                                                                       size_bytes=4096))
    assert not r.ok and "cannot open" in r.error


@pytest.mark.parametrize(("request_kwargs", "field"), [
    ({"token_ids": common_pb2.TokenIds(ids=[1, 2, 999_999])}, "prompt_token_ids"),
    ({"token_ids": common_pb2.TokenIds(ids=[5] * 9000)}, "prompt"),
    ({"text": "hi", "sampling": common_pb2.SamplingParameters(temperature=-1.0)}, "temperature"),
    ({"text": ""}, "prompt"),
    ({"text": "hi", "sampling": common_pb2.SamplingParameters(top_p=1.5)}, "top_p"),
    ({"text": "hi", "stopping": generation_pb2.StoppingCriteria(max_tokens=0)}, "max_tokens"),
    ({"text": "hi", "n": 1000}, "n"),  # REST caps n at 16; so does the public gRPC API (issue 26)
])
def test_invalid_requests_are_invalid_argument(stack: dict[str, str], request_kwargs: dict, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(_gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(**request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    text, _ = _collect(_gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(text="Hi", **_greedy(2))))
    assert text  # still serving


def test_request_id_is_echoed(stack: dict[str, str]) -> None:
    call = _gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(text="Hi", **_greedy(2)),
                                            metadata=(("x-request-id", "req-abc-123"),))
    msgs = list(call)
    assert dict(call.initial_metadata())["x-request-id"] == "req-abc-123"
    assert all(m.request_id == "req-abc-123" for m in msgs)


def _node_generate(addr: str, body: dict[str, object], *key: str) -> dict[str, object]:
    out = subprocess.run([shutil.which("node") or "node", str(ROOT / "tests/node/generate.js"), addr,
                          json.dumps(body), *key], capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_a_keyed_tokenizer_refuses_calls_without_its_key_and_serves_those_with_one(stack: dict[str, str]) -> None:
    """--api-key-file: Python and Node clients get UNAUTHENTICATED without a key or with a wrong one, and the
    same answer as from a keyless service with a key from the file; health needs no key (probes carry none)."""
    expected, _ = _collect(_gen_stub(stack["shm"]).Generate(generation_pb2.GenerateRequest(
        text="Name a colour.", **_greedy(6, ignore_eos=True))))
    stub = _gen_stub(stack["keyed"])
    request = generation_pb2.GenerateRequest(text="Name a colour.", **_greedy(6, ignore_eos=True))
    for metadata, details in [((), "missing API key: send `authorization: Bearer <key>` metadata"),
                              ((("authorization", "Bearer wrong"),), "invalid API key")]:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, metadata=metadata))
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    keyed = (("authorization", f"Bearer {KEY}"),)
    assert _collect(stub.Generate(request, metadata=keyed))[0] == expected
    stream = [generation_pb2.GenerateStreamRequest(id=1, generate=request)]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GenerateStream(iter(stream), timeout=60))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    items = [i for m in stub.GenerateStream(iter(stream), timeout=60, metadata=keyed) for i in m.items]
    assert "".join(i.response.text for i in items) == expected
    assert grpc_serving(stack["keyed"], "sluice.v1.Generation")

    body = {"text": "Name a colour.", "sampling": {"temperature": 0.0},
            "stopping": {"max_tokens": 6, "ignore_eos": True}}
    grpc_unauthenticated = 16
    assert _node_generate(stack["keyed"], body) == {"error": {"code": grpc_unauthenticated, "details":
                                                              "missing API key: send `authorization: Bearer <key>` "
                                                              "metadata"}}
    assert _node_generate(stack["keyed"], body, "wrong") == {"error": {"code": grpc_unauthenticated,
                                                                       "details": "invalid API key"}}
    served = _node_generate(stack["keyed"], body, KEY)
    assert served.get("error") is None and served["text"] == expected
