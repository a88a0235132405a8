"""Bad requests get their exact status and an OpenAI error body, and the ones the
gateway rejects never reach the backend; backend failures map onto statuses
without leaking transport details."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from proto.sluice.v1 import generation_pb2
from tests.gateway.conftest import API_KEY, SERVED, Gateway, GatewayFactory

pytestmark = pytest.mark.anyio

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 4096
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
OBJ = {"type": "object"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": OBJ}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@dataclass
class Case:
    id: str
    path: str
    body: Any = None  # JSON body
    status: int = 400
    param: str | None = None
    method: str = "POST"
    content: bytes | None = None  # raw body instead of JSON
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    chunked: bool = False


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED, "prompt": "hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": USER, **fields}


REJECTED = [
    Case("malformed-json", COMP, content=b'{"prompt": '),
    Case("json-not-object", COMP, content=b"[1, 2]"),
    Case("nan-is-not-json", COMP, content=b'{"prompt": "x", "temperature": NaN}'),
    Case("prompt-missing", COMP, {"model": SERVED}, param="prompt"),
    Case("prompt-empty-string", COMP, comp(prompt=""), param="prompt"),
    Case("prompt-empty-list", COMP, comp(prompt=[]), param="prompt"),
    Case("prompt-wrong-type", COMP, comp(prompt=5), param="prompt"),
    Case("prompt-list-empty-item", COMP, comp(prompt=["a", ""]), param="prompt[1]"),
    Case("prompt-list-bad-item", COMP, comp(prompt=["a", {"x": 1}]), param="prompt[1]"),
    Case("prompt-negative-token", COMP, comp(prompt=[[1, -1]]), param="prompt[0][1]"),
    Case("max-tokens-zero", COMP, comp(max_tokens=0), param="max_tokens"),
    Case("max-tokens-negative", COMP, comp(max_tokens=-5), param="max_tokens"),
    Case("max-tokens-string", COMP, comp(max_tokens="10"), param="max_tokens"),
    Case("max-tokens-fraction", COMP, comp(max_tokens=1.5), param="max_tokens"),
    Case("chat-max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), param="max_completion_tokens"),
    Case("temperature-negative", COMP, comp(temperature=-0.1), param="temperature"),
    Case("temperature-too-high", CHAT, chat(temperature=2.5), param="temperature"),
    Case("temperature-bool", COMP, comp(temperature=True), param="temperature"),
    Case("top-p-zero", COMP, comp(top_p=0), param="top_p"),
    Case("top-p-above-one", CHAT, chat(top_p=1.5), param="top_p"),
    Case("n-zero", COMP, comp(n=0), param="n"),
    Case("n-too-large", CHAT, chat(n=17), param="n"),
    Case("too-many-stops", COMP, comp(stop=["a", "b", "c", "d", "e"]), param="stop"),
    Case("stop-too-long", CHAT, chat(stop="x" * 300), param="stop"),
    Case("stop-wrong-type", COMP, comp(stop=[1]), param="stop"),
    Case("logprobs-too-large", COMP, comp(logprobs=21), param="logprobs"),
    Case("top-logprobs-too-large", CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
    Case("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), param="top_logprobs"),
    Case("chat-logprobs-not-bool", CHAT, chat(logprobs=3), param="logprobs"),
    Case("messages-empty", CHAT, chat(messages=[]), param="messages"),
    Case("messages-missing", CHAT, {"model": SERVED}, param="messages"),
    Case("message-bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), param="messages[0].role"),
    Case("message-audio-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]), param="messages[0].content[0]"),
    Case("message-image-detail", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x", "detail": "ultra"}}]}]),
         param="messages[0].content[0].image_url.detail"),
    Case("stream-options-without-stream", COMP, comp(stream_options={"include_usage": True}),
         param="stream_options"),
    Case("stream-not-bool", COMP, comp(stream="yes"), param="stream"),
    Case("seed-string", COMP, comp(seed="abc"), param="seed"),
    Case("presence-penalty-range", CHAT, chat(presence_penalty=3), param="presence_penalty"),
    Case("logit-bias-bad-key", COMP, comp(logit_bias={"abc": 1}), param="logit_bias"),
    Case("logit-bias-bad-value", COMP, comp(logit_bias={"1": 200}), param="logit_bias"),
    Case("min-tokens-above-max", COMP, comp(max_tokens=2, min_tokens=3), param="min_tokens"),
    Case("top-k-negative", COMP, comp(top_k=-2), param="top_k"),
    Case("stream-interval-zero", COMP, comp(stream_interval=0), param="stream_interval"),
    Case("stream-interval-string", COMP, comp(stream_interval="4"), param="stream_interval"),
    Case("chat-stream-interval-float", CHAT, chat(messages=[{"role": "user", "content": "x"}], stream_interval=1.5),
         param="stream_interval"),
    Case("repetition-penalty-zero", COMP, comp(repetition_penalty=0), param="repetition_penalty"),
    Case("suffix", COMP, comp(suffix="x"), param="suffix"),
    Case("echo-not-bool", COMP, comp(echo="yes"), param="echo"),
    # structured outputs
    Case("two-constraints", COMP, comp(guided_json=OBJ, guided_regex="x"), param="guided_regex"),
    Case("response-format-and-guided", CHAT, chat(response_format={"type": "json_object"}, guided_choice=["a"]),
         param="guided_choice"),
    Case("guided-and-structured-outputs", CHAT, chat(guided_grammar="root ::= \"a\"",
                                                     structured_outputs={"regex": "a"}),
         param="structured_outputs.regex"),
    Case("structured-outputs-two-keys", CHAT, chat(structured_outputs={"regex": "a", "choice": ["a"]}),
         param="structured_outputs.choice"),
    Case("structured-outputs-unknown-key", COMP, comp(structured_outputs={"structural_tag": "x"}),
         param="structured_outputs.structural_tag"),
    Case("structured-outputs-not-object", COMP, comp(structured_outputs="json"), param="structured_outputs"),
    Case("structured-outputs-json-object-string", COMP, comp(structured_outputs={"json_object": "yes"}),
         param="structured_outputs.json_object"),
    Case("guided-backend-other", COMP, comp(guided_regex="x", guided_decoding_backend="xgrammar"),
         param="guided_decoding_backend"),
    Case("guided-json-array", COMP, comp(guided_json=[1]), param="guided_json"),
    Case("guided-json-bad-text", CHAT, chat(guided_json="{not json"), param="guided_json"),
    Case("guided-regex-empty", COMP, comp(guided_regex=""), param="guided_regex"),
    Case("guided-grammar-not-string", COMP, comp(guided_grammar=5), param="guided_grammar"),
    Case("guided-choice-empty", COMP, comp(guided_choice=[]), param="guided_choice"),
    Case("guided-choice-bad-item", CHAT, chat(guided_choice=["a", 1]), param="guided_choice[1]"),
    Case("structural-tag", COMP, comp(structural_tag="{}"), param="structural_tag"),
    Case("response-format-unknown-type", CHAT, chat(response_format={"type": "xml"}), param="response_format.type"),
    Case("response-format-not-object", CHAT, chat(response_format="json"), param="response_format"),
    Case("response-format-no-json-schema", CHAT, chat(response_format={"type": "json_schema"}),
         param="response_format.json_schema"),
    Case("response-format-no-schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         param="response_format.json_schema.schema"),
    Case("response-format-strict-not-bool", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": OBJ, "strict": "yes"}}),
         param="response_format.json_schema.strict"),
    # tools
    Case("tools-not-array", CHAT, chat(tools={"type": "function"}), param="tools"),
    Case("tool-not-function", CHAT, chat(tools=[{"type": "retrieval"}]), param="tools[0].type"),
    Case("tool-without-name", CHAT, chat(tools=[{"type": "function", "function": {"parameters": OBJ}}]),
         param="tools[0].function.name"),
    Case("tool-parameters-not-object", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": [1]}}]), param="tools[0].function.parameters"),
    Case("tool-names-repeat", CHAT, chat(tools=[TOOL, TOOL]), param="tools[1].function.name"),
    Case("tool-choice-unknown", CHAT, chat(tools=[TOOL], tool_choice="maybe"), param="tool_choice"),
    Case("tool-choice-unknown-function", CHAT, chat(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "g"}}), param="tool_choice"),
    Case("tool-choice-bad-shape", CHAT, chat(tools=[TOOL], tool_choice={"type": "function"}), param="tool_choice"),
    Case("tool-choice-without-tools", CHAT, chat(tool_choice="required"), param="tool_choice"),
    Case("tool-choice-forced-with-guided", CHAT, chat(tools=[TOOL], tool_choice="required", guided_regex="x"),
         param="tool_choice"),
    Case("tools-in-completions", COMP, comp(tools=[TOOL]), param="tools"),
    Case("top-logprobs-in-completions", COMP, comp(top_logprobs=2), param="top_logprobs"),
    Case("tool-choice-in-completions", COMP, comp(tool_choice="auto"), param="tool_choice"),
    Case("legacy-functions", CHAT, chat(functions=[{"name": "f"}]), param="functions"),
    Case("legacy-function-call", CHAT, chat(function_call="auto"), param="function_call"),
    Case("parallel-tool-calls-not-bool", CHAT, chat(tools=[TOOL], parallel_tool_calls="no"),
         param="parallel_tool_calls"),
    Case("tool-message-without-id", CHAT, chat(messages=[*USER, {"role": "tool", "content": "sunny"}]),
         param="messages[1].tool_call_id"),
    Case("tool-call-id-on-user", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]),
         param="messages[0].tool_call_id"),
    Case("tool-calls-on-user", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]),
         param="messages[0].tool_calls"),
    Case("tool-call-without-id", CHAT, chat(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), param="messages[1].tool_calls[0].id"),
    Case("tool-call-arguments-object", CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": {}}}]}]), param="messages[1].tool_calls[0].function.arguments"),
    Case("tool-call-arguments-not-json", CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{city"}}]}]),
         param="messages[1].tool_calls[0].function.arguments"),
    Case("chat-template-not-string", CHAT, chat(chat_template=["x"]), param="chat_template"),
    Case("chat-template-kwargs-not-object", CHAT, chat(chat_template_kwargs="x"), param="chat_template_kwargs"),
    # best_of, beam search and the limits on n
    Case("chat-n-too-large", CHAT, chat(n=17), param="n"),
    Case("best-of-below-n", COMP, comp(n=3, best_of=2), param="best_of"),
    Case("best-of-above-max-n", COMP, comp(best_of=17), param="best_of"),
    Case("beam-width-above-max-n", CHAT, chat(use_beam_search=True, best_of=17), param="best_of"),
    Case("beam-n-above-max-n", COMP, comp(use_beam_search=True, n=17), param="n"),
    Case("use-beam-search-not-bool", COMP, comp(use_beam_search="yes"), param="use_beam_search"),
    Case("length-penalty-without-beams", COMP, comp(length_penalty=0.5), param="length_penalty"),
    Case("early-stopping-without-beams", COMP, comp(early_stopping=True), param="early_stopping"),
    Case("early-stopping-bad", COMP, comp(use_beam_search=True, early_stopping="sometimes"), param="early_stopping"),
    Case("length-penalty-range", COMP, comp(use_beam_search=True, length_penalty=50), param="length_penalty"),
    Case("beams-with-temperature", COMP, comp(use_beam_search=True, temperature=0.7), param="temperature"),
    Case("beams-with-top-k", CHAT, chat(use_beam_search=True, top_k=5), param="top_k"),
    Case("beams-with-seed", COMP, comp(use_beam_search=True, seed=1), param="seed"),
    # prompt_logprobs, priority
    Case("prompt-logprobs-too-large", COMP, comp(prompt_logprobs=21), param="prompt_logprobs"),
    Case("prompt-logprobs-negative", CHAT, chat(prompt_logprobs=-1), param="prompt_logprobs"),
    Case("prompt-logprobs-with-stream", COMP, comp(prompt_logprobs=1, stream=True), param="prompt_logprobs"),
    Case("priority-string", COMP, comp(priority="high"), param="priority"),
    Case("priority-beyond-int32", CHAT, chat(priority=2**31), param="priority"),
    Case("unknown-model", COMP, comp(model="gpt-4"), status=404, param="model"),
    Case("unknown-model-chat", CHAT, chat(model="nope"), status=404, param="model"),
    Case("body-too-large", COMP, comp(prompt="x" * (MAX_BODY + 10)), status=413),
    Case("body-too-large-chunked", COMP, content=b"x" * (MAX_BODY + 10), status=413, chunked=True),
    Case("missing-auth", COMP, comp(), status=401, headers={}),
    Case("wrong-key", COMP, comp(), status=401, headers={"Authorization": "Bearer sk-wrong"}),
    Case("basic-auth", COMP, comp(), status=401, headers={"Authorization": f"Basic {API_KEY}"}),
    Case("key-prefix", COMP, comp(), status=401, headers={"Authorization": f"Bearer {API_KEY[:-1]}"}),
    # The Host header makes Starlette's request.url.path read "/health"; auth uses the ASGI path.
    Case("host-header-trick", COMP, comp(), status=401, headers={"Host": "example.com/health?x="}),
    Case("public-path-lookalike", "/metrics/../v1/models", status=401, method="GET", headers={}),
    Case("public-path-prefix", "/healthz", status=401, method="GET", headers={}),
    Case("unknown-route", "/v1/nothing", comp(), status=404),
    Case("unknown-route-no-auth", "/v1/nothing", comp(), status=401, headers={}),
    Case("trailing-slash-not-redirected", "/v1/models/", status=404, method="GET"),
    Case("wrong-method-get", COMP, status=405, method="GET"),
    Case("wrong-method-post-health", "/health", {}, status=405),
    Case("tokenize-prompt-missing", "/tokenize", {}, param="prompt"),
    Case("detokenize-bad-token", "/detokenize", {"tokens": ["a"]}, param="tokens[0]"),
    Case("tokenize-unknown-model", "/tokenize", {"model": "x", "prompt": "y"}, status=404, param="model"),
]


def check_error_body(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    for leak in ("Traceback", "/work", "127.0.0.1", "ipv4:"):
        assert leak not in r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] == param
    if param is not None:
        assert param in err["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    if status == 429:
        assert r.headers["retry-after"].isdigit()
    return err


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 1000):
        yield data[i:i + 1000]


async def send(gw: Gateway, case: Case) -> httpx.Response:
    kwargs: dict[str, Any] = {"headers": case.headers}
    if case.content is not None:  # raw bytes, sent as JSON
        kwargs["headers"] = {"Content-Type": "application/json", **case.headers}
    if case.chunked:
        kwargs["content"] = _chunks(case.content or b"")
    elif case.content is not None:
        kwargs["content"] = case.content
    elif case.body is not None:
        kwargs["json"] = case.body
    return await gw.client.request(case.method, case.path, **kwargs)


@pytest.mark.parametrize("case", REJECTED, ids=[c.id for c in REJECTED])
async def test_gateway_rejects_without_calling_the_backend(make_gateway: GatewayFactory, case: Case) -> None:
    async with make_gateway(api_keys=(API_KEY,), max_body_bytes=MAX_BODY) as gw:
        r = await send(gw, case)
        err = check_error_body(r, case.status, case.param)
        if case.status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
        if case.status == 405:
            assert "allow" in r.headers
        unknown_model = "unknown-model" in case.id
        if unknown_model:
            assert err["code"] == "model_not_found"
        assert gw.backend_calls.generate_requests == []
        # An unknown model asks the backend once whether a LoRA adapter could have the name (LoRA is off here).
        assert gw.backend_calls.unary_requests == ([generation_pb2.GetModelInfoRequest()] if unknown_model else [])


BACKEND = [
    # (prompt command, expected status, expected param)
    ("abort:INVALID_ARGUMENT:stop_token_ids: token id [99999] out of range [0, 49152)", 400, "stop_token_ids"),
    ("abort:INVALID_ARGUMENT:the prompt is longer than the model's context", 400, None),
    ("abort:RESOURCE_EXHAUSTED:waiting queue is full (max_queued_requests=8)", 429, None),
    ("abort:UNAVAILABLE:failed to connect to all addresses; last error: ipv4:127.0.0.1:50051", 503, None),
    ("abort:DEADLINE_EXCEEDED:Deadline Exceeded", 504, None),
    ("abort:NOT_FOUND:no model named x", 404, None),
    ("abort:INTERNAL:Traceback (most recent call last): File /work/main/engine/core.py", 500, None),
    ("abort:UNKNOWN:Exception calling application: /work/main/x.py", 500, None),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("command", "status", "param"), BACKEND, ids=[b[0].split(":")[1] + str(i)
                                                                        for i, b in enumerate(BACKEND)])
async def test_backend_errors_map_to_statuses(gateway: Gateway, command: str, status: int, param: str | None,
                                              stream: bool) -> None:
    r = await gateway.client.post(COMP, json=comp(prompt=command, stream=stream))
    check_error_body(r, status, param)
    assert len(gateway.backend_calls.generate_requests) == 1
    if status == 429:
        assert r.headers["retry-after"] == "1"


async def test_chat_backend_error_maps_too(gateway: Gateway) -> None:
    r = await gateway.client.post(CHAT, json=chat(messages=[
        {"role": "user", "content": "abort:RESOURCE_EXHAUSTED:queue full"}]))
    check_error_body(r, 429)


async def test_request_timeout_is_a_504(make_gateway: GatewayFactory) -> None:
    async with make_gateway(request_timeout=0.3) as gw:
        r = await gw.client.post(COMP, json=comp(prompt="slow:5"))
        check_error_body(r, 504)
        # The gateway's deadline went to the backend with the call, which sees it cancelled.
        await gw.backend_calls.cancelled.wait()


async def test_backend_down_is_a_503(make_gateway: GatewayFactory) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with make_gateway(tokenizer_addresses=(f"127.0.0.1:{port}",)) as gw:
        for path, body in ((COMP, comp()), (CHAT, chat()), ("/tokenize", {"prompt": "x"})):
            r = await gw.client.post(path, json=body)
            check_error_body(r, 503)
        r = await gw.client.get("/ready")
        check_error_body(r, 503)


async def test_sequence_failure_is_a_500_without_details(gateway: Gateway) -> None:
    r = await gateway.client.post(COMP, json=comp(prompt="fail", n=2))
    err = check_error_body(r, 500)
    assert r.headers["x-request-id"] in err["message"]
    assert "device lost" not in r.text


async def test_retry_after_comes_from_the_backend_when_it_says(gateway: Gateway) -> None:
    r = await gateway.client.post(COMP, json=comp(prompt="busy:7"))
    check_error_body(r, 429)
    assert r.headers["retry-after"] == "7"
    assert r.json()["error"]["message"] == "The server is busy: queue full. Retry later."   # the backend's reason


SIZES = [
    ("guided_json", {"guided_json": {"type": "object", "description": "x" * (64 * 1024)}}),
    ("response_format.json_schema.schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": {"type": "object", "description": "x" * (64 * 1024)}}}}),
    ("guided_regex", {"guided_regex": "a" * (64 * 1024 + 1)}),
    ("structured_outputs.grammar", {"structured_outputs": {"grammar": "a" * (64 * 1024 + 1)}}),
    ("guided_choice", {"guided_choice": ["a"] * 1025}),
    ("guided_choice", {"guided_choice": ["x" * 1024] * 65}),  # 1024 entries at most, 64 KiB in all
]


@pytest.mark.parametrize(("param", "fields"), SIZES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(SIZES)])
async def test_constraints_are_bounded(gateway: Gateway, param: str, fields: dict[str, Any]) -> None:
    r = await gateway.client.post(CHAT, json=chat(**fields))
    check_error_body(r, 400, param)
    assert gateway.backend_calls.generate_requests == []


async def test_constraints_at_their_bounds_are_accepted(gateway: Gateway) -> None:
    for fields in ({"guided_regex": "a" * (64 * 1024)}, {"guided_choice": ["a"] * 1024}):
        r = await gateway.client.post(CHAT, json=chat(**fields))
        assert r.status_code == 200, r.text
    regex, choice = (req.guided for req in gateway.backend_calls.generate_requests)
    assert regex.regex == "a" * (64 * 1024) and list(choice.choice.choices) == ["a"] * 1024
