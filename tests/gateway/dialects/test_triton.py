"""Triton's generate extension and health routes against the fake backend: fields from the top level or from
``parameters``, ``text_output`` whole or streamed, and ``{"error": ...}`` with the OpenAI routes' status."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.conftest import SERVED, Gateway
from tests.gateway.dialects.sse import events

pytestmark = pytest.mark.anyio

GENERATE = f"/v2/models/{SERVED}/generate"


async def test_generate_reads_parameters(gateway: Gateway) -> None:
    r = await gateway.client.post(GENERATE, json={"id": "a1", "text_input": "hello", "parameters": {
        "max_tokens": 2, "temperature": 0, "top_p": 0.9, "seed": 5, "stop": ["zz"], "details": True,
        "timeout": 30}})
    assert r.status_code == 200
    assert r.json() == {"id": "a1", "model_name": SERVED, "model_version": "1", "text_output": "Hello",
                        "details": {"finish_reason": "length", "generated_tokens": 2, "input_length": 1}}
    (req,) = gateway.backend_calls.generate_requests
    assert (req.stopping.max_tokens, list(req.stopping.stop), req.sampling.seed) == (2, ["zz"], 5)
    assert (req.sampling.temperature, round(req.sampling.top_p, 3)) == (0.0, 0.9)


async def test_tensorrt_llm_inputs_at_the_top_level(gateway: Gateway) -> None:
    r = await gateway.client.post(GENERATE, json={"text_input": "hello", "max_tokens": 3, "bad_words": "",
                                                  "stop_words": "", "stream": False,
                                                  "parameters": {"exclude_input_in_output": False}})
    assert r.json()["text_output"] == "helloHello world"
    (req,) = gateway.backend_calls.generate_requests
    assert (req.stopping.max_tokens, list(req.stopping.stop), list(req.bad_words)) == (3, [], [])


@pytest.mark.parametrize(("body", "words"), [
    ({"bad_words": "world"}, ["world"]),
    ({"parameters": {"bad_words": ["world", "Hello"]}}, ["world", "Hello"]),
])
async def test_bad_words_reach_the_request(gateway: Gateway, body: dict[str, Any], words: list[str]) -> None:
    r = await gateway.client.post(GENERATE, json={"text_input": "hello", **body})
    assert r.status_code == 200
    (req,) = gateway.backend_calls.generate_requests
    assert list(req.bad_words) == words


async def test_mindies_do_sample_false_is_greedy(gateway: Gateway) -> None:
    await gateway.client.post(GENERATE, json={"text_input": "hello", "parameters": {
        "do_sample": False, "max_new_tokens": 2, "watermark": False}})
    (req,) = gateway.backend_calls.generate_requests
    assert (req.sampling.temperature, req.stopping.max_tokens) == (0.0, 2)


async def test_generate_stream(gateway: Gateway) -> None:
    r = await gateway.client.post(f"{GENERATE}_stream", json={"text_input": "hello", "parameters": {
        "stream": True, "details": True}})
    got = events(r.text)
    head = {"model_name": SERVED, "model_version": "1"}
    assert got == [{**head, "text_output": "Hel"}, {**head, "text_output": "lo"}, {
        **head, "text_output": " world", "details": {"finish_reason": "eos_token", "generated_tokens": 3,
                                                     "input_length": 1}}]


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    (GENERATE, {"text_input": "hi", "foo": 1}, 400, "Unexpected inference input `foo`"),
    (GENERATE, {"text_input": "hi", "max_tokens": 2, "parameters": {"max_tokens": 2}}, 400,
     "`max_tokens` is given both as an input and in `parameters`: give one."),
    (GENERATE, {"text_input": "hi", "parameters": {"max_tokens": 2, "max_new_tokens": 2}}, 400,
     "`parameters.max_new_tokens` and `parameters.max_tokens` are the same field: give one."),
    (GENERATE, {"text_input": "hi", "parameters": {"stream": True}}, 400,
     "`parameters.stream` is true: use /generate_stream."),
    (f"{GENERATE}_stream", {"text_input": "hi", "stream": False}, 400, "`stream` is false: use /generate."),
    (GENERATE, {"text_input": "hi", "parameters": {"typical_p": 0.5}}, 400,
     "`parameters.typical_p` is not supported: typical decoding is not implemented."),
    (GENERATE, {"text_input": "hi", "parameters": {"max_new_tokens": 0}}, 400,
     "`parameters.max_new_tokens`: input should be greater than or equal to 1."),
    (GENERATE, {"text_input": "hi", "parameters": {"temperature": "hot"}}, 400,
     "`parameters.temperature` must be a number, got string."),
    (GENERATE, {"parameters": {}}, 400, "`text_input` is required."),
    ("/v2/models/nope/generate", {"text_input": "hi"}, 404, "The model `nope` does not exist."),
])
async def test_refusals(gateway: Gateway, path: str, body: dict[str, Any], status: int, message: str) -> None:
    r = await gateway.client.post(path, json=body)
    assert r.status_code == status
    assert list(r.json()) == ["error"]
    assert r.json()["error"].startswith(message)
    assert not gateway.backend_calls.generate_requests


async def test_backend_failures(gateway: Gateway) -> None:
    r = await gateway.client.post(GENERATE, json={"text_input": "busy:4"})
    assert (r.status_code, r.headers["retry-after"]) == (429, "4")
    assert r.json() == {"error": "The server is busy: queue full. Retry later."}   # the backend's reason
    r = await gateway.client.post(f"{GENERATE}_stream", json={"text_input": "fail"})
    assert events(r.text)[-1] == {"error": f"The server had an error while processing the request (request id "
                                           f"{r.headers['x-request-id']})."}


async def test_health(gateway: Gateway) -> None:
    assert (await gateway.client.get("/v2/health/live")).status_code == 200
    assert (await gateway.client.get("/v2/health/ready")).status_code == 200
    assert (await gateway.client.get(f"/v2/models/{SERVED}/ready")).status_code == 200
    r = await gateway.client.get("/v2/models/nope/ready")
    assert (r.status_code, r.json()) == (404, {"error": "The model `nope` does not exist."})
    await gateway.fake.set_serving(False)
    assert (await gateway.client.get("/v2/health/ready")).status_code == 400
    assert (await gateway.client.get("/v2/health/live")).status_code == 200
