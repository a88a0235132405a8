"""The gateway end to end over HTTP (real uvicorn) against the fake Generation server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.app import create_app
from gateway.backend import GenerateCall
from gateway.client import GrpcBackend
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from proto.sluice.v1 import generation_pb2
from tests.gateway.conftest import SERVED, Gateway, GatewayFactory
from tests.gateway.fakes import FakeServer

pytestmark = pytest.mark.anyio

USAGE_3 = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}


def sse_data(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert body.endswith("\n\n")
    out = []
    for frame in body.split("\n\n")[:-1]:
        assert frame.startswith("data: ") or frame == ": keep-alive", frame
        if frame.startswith("data: "):
            out.append(frame[len("data: "):])
    return out


async def test_completion_json(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"model": SERVED, "prompt": "Say hi", "max_tokens": 20,
                                                           "temperature": 0.5, "top_p": 0.9, "seed": 7})
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == f"cmpl-{r.headers['x-request-id']}"
    assert body["object"] == "text_completion"
    assert body["model"] == SERVED
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop",
                                "stop_reason": None}]
    assert body["usage"] == USAGE_3
    (sent,) = gateway.backend_calls.generate_requests
    assert sent.text == "Say hi"
    assert sent.stopping.max_tokens == 20
    assert sent.sampling.temperature == pytest.approx(0.5)
    assert sent.sampling.top_p == pytest.approx(0.9)
    assert sent.sampling.seed == 7
    assert not sent.sampling.HasField("top_k")


async def test_completion_length_and_default_max_tokens(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
    assert r.json()["choices"][0] == {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}
    assert r.json()["model"] == SERVED  # no model given: the served one
    await gateway.client.post("/v1/completions", json={"prompt": "x"})
    assert gateway.backend_calls.generate_requests[1].stopping.max_tokens == 16  # OpenAI's default


async def test_completion_stop_string_is_stop(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "x", "stop": ["END", "\n"]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["stop_reason"] == "END"
    assert list(gateway.backend_calls.generate_requests[0].stopping.stop) == ["END", "\n"]


async def test_completion_n_and_batched_prompts_index_choices(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions",
                                  json={"prompt": ["one two", [5, 6, 7]], "n": 2, "max_tokens": 30})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hello world" for c in body["choices"])
    # prompt 0: 2 words, prompt 1: 3 ids; each prompt's 2 sequences made 3 tokens each
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 12
    sent = gateway.backend_calls.generate_requests
    assert sorted(m.WhichOneof("input") for m in sent) == ["text", "token_ids"]
    assert {m.n for m in sent} == {2}
    rid = r.headers["x-request-id"]
    assert sorted(m.request_id for m in sent) == [f"{rid}-0", f"{rid}-1"]


async def test_completion_token_id_prompt(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": [1, 2, 3, 4]})
    assert r.status_code == 200
    assert list(gateway.backend_calls.generate_requests[0].token_ids.ids) == [1, 2, 3, 4]
    assert r.json()["usage"]["prompt_tokens"] == 4


async def test_completion_logprobs_legacy_format(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "x", "logprobs": 1, "max_tokens": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.5],
                  "top_logprobs": [{"Hel": -0.5, "alt0": -1.0}, {"lo": -0.5, "alt0": -1.0}], "text_offset": [0, 3]}
    sent = gateway.backend_calls.generate_requests[0]
    assert sent.response.logprobs and sent.response.top_logprobs == 1


async def test_vllm_extras_reach_the_backend(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={
        "prompt": "x", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2,
        "stop_token_ids": [7, 8], "skip_special_tokens": False, "include_stop_str_in_output": True,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"42": 5, "7": -100}, "echo": True,
        "user": "u1", "unknown_field": {"ignored": True}})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "xHello world"  # echoed by the service (the fake's way)
    sent = gateway.backend_calls.generate_requests[0]
    assert sent.sampling.top_k == 5
    assert sent.sampling.min_p == pytest.approx(0.1)
    assert sent.sampling.repetition_penalty == pytest.approx(1.2)
    assert sent.sampling.presence_penalty == pytest.approx(0.5)
    assert sent.sampling.frequency_penalty == pytest.approx(-0.5)
    assert dict(sent.sampling.logit_bias) == {42: 5.0, 7: -100.0}
    assert sent.stopping.ignore_eos and sent.stopping.include_stop_str_in_output
    assert sent.stopping.min_tokens == 2
    assert list(sent.stopping.stop_token_ids) == [7, 8]
    assert sent.response.HasField("skip_special_tokens") and not sent.response.skip_special_tokens
    assert sent.response.echo


async def test_chat_json(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/chat/completions", json={
        "model": SERVED, "max_completion_tokens": 10,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
                      "name": "ann"},
                     {"role": "assistant", "content": None},
                     {"role": "developer", "content": "Really brief."}]})
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == f"chatcmpl-{r.headers['x-request-id']}"
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello world"},
                                "logprobs": None, "finish_reason": "stop", "stop_reason": None}]
    assert body["usage"]["completion_tokens"] == 3
    sent = gateway.backend_calls.generate_requests[0]
    assert [(m.role, m.content) for m in sent.chat.messages] == [
        ("system", "Be brief."), ("user", "Hi\nthere"), ("assistant", ""), ("system", "Really brief.")]
    assert sent.chat.messages[1].name == "ann"
    assert sent.chat.add_generation_prompt
    assert sent.stopping.max_tokens == 10


async def test_chat_logprobs_format(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2, "max_tokens": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp == {"content": [{"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"), "top_logprobs": [
        {"token": "alt0", "logprob": -1.0, "bytes": list(b"alt0")},
        {"token": "alt1", "logprob": -2.0, "bytes": list(b"alt1")}]}]}


async def test_completion_stream_framing_and_usage(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={
        "prompt": "a b", "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == f"cmpl-{r.headers['x-request-id']}" for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hel", "lo", " world"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE_3
    assert all("usage" not in c for c in chunks[:-1])


async def test_stream_without_include_usage_has_no_usage(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "a", "stream": True})
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    assert len(chunks) == 3 and all("usage" not in c for c in chunks)


async def test_chat_stream_with_n(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
        "stream_options": {"include_usage": True}})
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    texts: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks[2:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Hello world", 1: "Hello world"}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == 4


async def test_models_tokenize_detokenize(gateway: Gateway) -> None:
    r = await gateway.client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [SERVED]
    assert r.json()["object"] == "list"
    r = await gateway.client.post("/tokenize", json={"prompt": "one two three", "return_token_strs": True})
    assert r.json() == {"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3], "token_strs": ["one", "two", "three"]}
    r = await gateway.client.post("/tokenize", json={"messages": [{"role": "user", "content": "a b"}]})
    assert r.json()["tokens"] == [1, 2] and r.json()["token_strs"] is None
    tok_req = gateway.backend_calls.unary_requests[-1]
    assert isinstance(tok_req, generation_pb2.TokenizeRequest) and tok_req.chat.add_generation_prompt
    r = await gateway.client.post("/detokenize", json={"tokens": [4, 5]})
    assert r.json() == {"prompt": "t4 t5"}


async def test_model_name_from_backend_when_not_configured(make_gateway: GatewayFactory) -> None:
    async with make_gateway(served_model_names=()) as gw:
        r = await gw.client.get("/v1/models")
        assert [m["id"] for m in r.json()["data"]] == ["fake-model"]
        r = await gw.client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
        assert r.status_code == 200 and r.json()["model"] == "fake-model"


async def test_health_ready_and_metrics(gateway: Gateway) -> None:
    assert (await gateway.client.get("/health")).json() == {"status": "ok"}
    assert (await gateway.client.get("/ready")).status_code == 200
    await gateway.fake.set_serving(False)
    r = await gateway.client.get("/ready")
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    await gateway.fake.set_serving(True)   # back in the channel's rotation once the news arrives
    not_ready = 1
    for _ in range(100):
        if (await gateway.client.get("/ready")).status_code == 200:
            break
        not_ready += 1
        await asyncio.sleep(0.02)
    await gateway.client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    r = await gateway.client.post("/v1/completions", json={"prompt": "abort:RESOURCE_EXHAUSTED:full"})
    assert r.status_code == 429
    r = await gateway.client.post("/v1/completions", json={"prompt": "abort:UNAVAILABLE:down", "stream": True})
    assert r.status_code == 503
    text = (await gateway.client.get("/metrics")).text
    assert f'sluice:request_success_total{{finished_reason="length",model_name="{SERVED}"}} 1.0' in text
    assert f'sluice:prompt_tokens_total{{model_name="{SERVED}"}} 2.0' in text
    assert f'sluice:generation_tokens_total{{model_name="{SERVED}"}} 2.0' in text
    assert f'sluice:time_to_first_token_seconds_count{{model_name="{SERVED}"}} 1.0' in text
    assert f'sluice:e2e_request_latency_seconds_count{{model_name="{SERVED}"}} 1.0' in text
    assert f'sluice:num_requests_running{{model_name="{SERVED}"}} 0.0' in text
    assert f'sluice:http_requests_total{{method="GET",route="/ready",status="503"}} {not_ready:.1f}' in text
    assert 'sluice:http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text
    assert 'sluice:http_requests_total{method="POST",route="/v1/completions",status="429"} 1.0' in text


async def test_request_id_is_echoed_and_forwarded(gateway: Gateway) -> None:
    r = await gateway.client.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "cmpl-abc-123"
    assert gateway.backend_calls.request_ids == ["abc-123"]
    assert gateway.backend_calls.generate_requests[0].request_id == "abc-123"
    # Not a sane token (gRPC metadata must be printable ASCII): replaced by a generated id.
    r = await gateway.client.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "a b\tc"})
    assert len(r.headers["x-request-id"]) == 32 and r.headers["x-request-id"] != "a b\tc"
    r = await gateway.client.get("/nope")
    assert len(r.headers["x-request-id"]) == 32


async def test_cors_off_by_default_and_on_when_asked(make_gateway: GatewayFactory) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    async with make_gateway() as gw:
        r = await gw.client.get("/health", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers
    async with make_gateway(allowed_origins=("https://app.example",), api_keys=("k",)) as gw:
        r = await gw.client.options("/v1/completions", headers=preflight)
        assert r.status_code == 200  # preflights carry no key
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = await gw.client.get("/health", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"


async def test_cors_credentials_methods_and_headers_as_vllm_names_them(make_gateway: GatewayFactory) -> None:
    origin = "https://app.example"
    ask = {"Origin": origin, "Access-Control-Request-Method": "DELETE",
           "Access-Control-Request-Headers": "X-Custom"}
    async with make_gateway(allowed_origins=(origin,)) as gw:   # the defaults: no credentials, our own lists
        r = await gw.client.options("/v1/completions", headers=ask)
        assert r.status_code == 400 and "access-control-allow-credentials" not in r.headers
    async with make_gateway(allowed_origins=(origin,), allow_credentials=True, allowed_methods=("*",),
                            allowed_headers=("X-Custom",)) as gw:
        r = await gw.client.options("/v1/completions", headers=ask)
        assert r.status_code == 200
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "DELETE" in r.headers["access-control-allow-methods"]
        assert "x-custom" in r.headers["access-control-allow-headers"].lower()


async def test_auth_accepts_the_key(make_gateway: GatewayFactory) -> None:
    async with make_gateway(api_keys=("k1", "k2")) as gw:
        for key in ("k1", "k2"):
            r = await gw.client.post("/v1/completions", json={"prompt": "x"},
                                     headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert (await gw.client.get(path)).status_code == 200


async def test_openai_sdk_json_and_stream(live_gateway: Gateway) -> None:
    gateway = live_gateway
    import openai

    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        chat = await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content == "Hello world"
        assert chat.choices[0].finish_reason == "stop"
        assert chat.usage is not None and chat.usage.completion_tokens == 3
        stream = await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}],
                                                      stream=True, stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        assert "".join(parts) == "Hello world"
        assert usage is not None and usage.total_tokens == usage.prompt_tokens + 3
        # keep-alive comments (interval 0.2 s) before the first token are skipped by the SDK
        stream = await client.completions.create(model=SERVED, prompt="slow:0.5", stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == "Hello world"
        comp = await client.completions.create(model=SERVED, prompt="a b", max_tokens=2)
        assert comp.choices[0].text == "Hello" and comp.choices[0].finish_reason == "length"
        models = await client.models.list()
        assert [m.id for m in models.data] == [SERVED]
        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="other", prompt="x")
        assert info.value.status_code == 404
    finally:
        await client.close()


@pytest.mark.parametrize("mux", [False, True], ids=["calls", "mux"])
async def test_a_batched_prompt_whose_call_cannot_start_aborts_the_calls_already_started(
        fake_server: FakeServer, mux: bool) -> None:
    settings = GatewaySettings(tokenizer_addresses=(fake_server.address,), served_model_names=(SERVED,),
                               tokenizer_mux=mux)
    backend = GrpcBackend.connect(settings.tokenizer_addresses, mux=mux)
    started: list[GenerateCall] = []
    cancelled: list[GenerateCall] = []

    class Recording:
        def __init__(self, call: GenerateCall) -> None:
            self.call = call

        def __aiter__(self):  # type: ignore[no-untyped-def]
            return self.call.__aiter__()

        def cancel(self) -> None:
            cancelled.append(self)
            self.call.cancel()

    def generate(prompt, params, *, request_id, timeout, adapter):  # type: ignore[no-untyped-def]
        if prompt.text == "cannot start":
            raise ValueError("no such call")
        started.append(Recording(GrpcBackend.generate(backend, prompt, params, request_id=request_id,
                                                      timeout=timeout, adapter=adapter)))
        return started[-1]

    backend.generate = generate  # type: ignore[method-assign]
    app = create_app(settings, backend, GatewayMetrics())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False),
                                     base_url="http://gateway.test") as client:
            r = await client.post("/v1/completions", json={"model": SERVED, "prompt": ["stall", "cannot start"],
                                                           "stream": True})
        assert r.status_code == 500
        assert len(started) == 1 and cancelled == started  # the stalled call was aborted, not left running
        servicer = fake_server.servicer
        # The backend saw the cancel, unless the call was cancelled before reaching it: then no request arrives
        # (one sent arrives on loopback within milliseconds; 1 s allows for a loaded host).
        for i in range(100):
            if servicer.cancelled.is_set() or (i >= 20 and not servicer.generate_requests):
                break
            await asyncio.sleep(0.05)
        assert servicer.cancelled.is_set() or not servicer.generate_requests
    finally:
        await backend.close()
