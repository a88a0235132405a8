"""TGI's dialect against the fake backend: each body becomes the exact ``GenerateRequest`` a completion would,
answers parse as TGI's own client models (``text_generation.types``), and every refusal and failure comes back
as TGI's ``{"error", "error_type"}`` with TGI's status."""

from __future__ import annotations

from typing import Any

import pytest
from text_generation.types import Parameters as TgiParameters
from text_generation.types import Request as TgiRequest
from text_generation.types import Response as TgiResponse
from text_generation.types import StreamResponse

from proto.sluice.v1 import common_pb2, generation_pb2
from tests.gateway.conftest import SERVED, Gateway, GatewayFactory
from tests.gateway.dialects.sse import events

pytestmark = pytest.mark.anyio

Req = generation_pb2.GenerateRequest
TOKENS = [{"id": 10, "text": "Hel", "logprob": -0.5, "special": False},
          {"id": 11, "text": "lo", "logprob": -0.5, "special": False},
          {"id": 12, "text": " world", "logprob": -0.5, "special": False}]


def sent(gateway: Gateway) -> Req:
    (req,) = gateway.backend_calls.generate_requests
    return req


def expected(**stopping: Any) -> Req:
    """A greedy request for "hello" with TGI's default of 20 new tokens, changed by the test."""
    req = Req(request_id="rid", n=1, text="hello", stopping=generation_pb2.StoppingCriteria(max_tokens=20),
              response=generation_pb2.ResponseOptions())
    req.sampling.temperature = 0.0
    for name, value in stopping.items():
        setattr(req.stopping, name, value)
    return req


def same(got: Req, want: Req) -> None:
    got = Req.FromString(got.SerializeToString())
    got.request_id = "rid"
    assert got == want


async def test_defaults_are_greedy_with_twenty_new_tokens(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={"inputs": "hello"})
    assert r.status_code == 200
    assert r.json() == {"generated_text": "Hello world"}
    same(sent(gateway), expected())


async def test_truncate_keeps_the_prompts_last_tokens(gateway: Gateway) -> None:
    # The body TGI's own client sends for client.generate("hello", truncate=3).
    body = TgiRequest(inputs="hello", parameters=TgiParameters(truncate=3), stream=False).dict()
    r = await gateway.client.post("/", json=body)
    assert r.status_code == 200, r.text
    want = expected()
    want.truncate_prompt_tokens = 3
    same(sent(gateway), want)


async def test_parameters_map_onto_the_completion_request(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={"inputs": "hello", "parameters": {
        "max_new_tokens": 2, "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3,
        "repetition_penalty": 1.1, "frequency_penalty": 0.5, "stop": ["zz"], "details": True, "top_n_tokens": 2,
        "priority": 0, "adapter_id": "None", "watermark": False, "typical_p": None, "truncate": None}})
    assert r.status_code == 200, r.text
    want = expected(max_tokens=2)
    want.stopping.stop.append("zz")
    want.sampling.temperature = 0.7
    want.sampling.top_k, want.sampling.top_p, want.sampling.seed = 5, 0.9, 3
    want.sampling.repetition_penalty, want.sampling.frequency_penalty = 1.1, 0.5
    want.response.logprobs, want.response.top_logprobs = True, 2
    same(sent(gateway), want)
    body = r.json()
    TgiResponse(**body)
    tops = [[{"id": 100, "text": "alt0", "logprob": -1.0, "special": False},
             {"id": 101, "text": "alt1", "logprob": -2.0, "special": False}]] * 2
    assert body == {"generated_text": "Hello", "details": {
        "finish_reason": "length", "generated_tokens": 2, "seed": 3, "prefill": [], "tokens": TOKENS[:2],
        "top_tokens": tops, "best_of_sequences": None}}


async def test_do_sample_alone_samples_at_the_backends_temperature(gateway: Gateway) -> None:
    await gateway.client.post("/generate", json={"inputs": "hello", "parameters": {"do_sample": True}})
    assert not sent(gateway).sampling.HasField("temperature")


async def test_grammar_is_a_guided_constraint(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={"inputs": "hello", "parameters": {
        "grammar": {"type": "regex", "value": "[ab]+"}}})
    assert r.status_code == 200
    assert sent(gateway).guided == common_pb2.GuidedDecoding(regex="[ab]+")


async def test_details_with_prefill_and_full_text(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={"inputs": "say hello", "parameters": {
        "details": True, "decoder_input_details": True, "return_full_text": True, "stop": ["world"]}})
    assert sent(gateway).response.prompt_logprobs == 0
    body = r.json()
    TgiResponse(**body)
    assert body["generated_text"] == "say helloHello world"
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["prefill"] == [{"id": 1, "text": "say", "logprob": None},
                                          {"id": 2, "text": " hello", "logprob": -0.25}]
    assert body["details"]["tokens"] == TOKENS


async def test_root_answers_a_list_and_streams_tgis_events(gateway: Gateway) -> None:
    r = await gateway.client.post("/", json={"inputs": "hello", "parameters": {"details": True}})
    assert r.status_code == 200
    assert r.json() == [{"generated_text": "Hello world", "details": {
        "finish_reason": "eos_token", "generated_tokens": 3, "seed": None, "prefill": [], "tokens": TOKENS,
        "top_tokens": None, "best_of_sequences": None}}]
    r = await gateway.client.post("/", json={"inputs": "hello", "stream": True, "parameters": {"details": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    for ev in got:
        StreamResponse(**ev)
    assert got == [{"index": i, "token": TOKENS[i], "generated_text": None, "details": None} for i in range(2)] + [
        {"index": 2, "token": TOKENS[2], "generated_text": "Hello world",
         "details": {"finish_reason": "eos_token", "generated_tokens": 3, "seed": None, "input_length": 1}}]


async def test_generate_stream_and_generate_with_stream(gateway: Gateway) -> None:
    for path, body in (("/generate_stream", {"inputs": "hello"}), ("/generate", {"inputs": "hello", "stream": True})):
        r = await gateway.client.post(path, json=body)
        got = events(r.text)
        assert [ev["token"]["text"] for ev in got] == ["Hel", "lo", " world"]
        assert [ev["token"]["logprob"] for ev in got] == [None] * 3  # no details: no log probabilities asked for
        assert got[-1]["generated_text"] == "Hello world"


async def test_info(gateway: Gateway) -> None:
    r = await gateway.client.get("/info")
    body = r.json()
    assert (body["model_id"], body["max_total_tokens"], body["max_input_tokens"]) == (SERVED, 2048, 2047)
    assert body["models"][0]["model_id"] == SERVED


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"inputs": "hello", "parameters": {"watermark": True}}, 422,
     "`parameters.watermark` is not supported: watermarking is not implemented."),
    ({"inputs": "hello", "parameters": {"typical_p": 0.5}}, 422,
     "`parameters.typical_p` is not supported: typical decoding is not implemented."),
    ({"inputs": "hello", "parameters": {"truncate": 0}}, 422,
     "`parameters.truncate`: input should be greater than or equal to 1."),
    ({"inputs": "hello", "stream": True, "parameters": {"decoder_input_details": True}}, 422,
     "`parameters.decoder_input_details` is not available when streaming."),
    ({"inputs": "hello", "stream": True, "parameters": {"best_of": 2}}, 422,
     "`parameters.best_of` > 1 is not available when streaming."),
    ({"inputs": "hello", "parameters": {"top_n_tokens": 2}}, 422,
     "`parameters.top_n_tokens` needs `parameters.details` set to true."),
    ({"inputs": "hello", "parameters": {"max_new_tokens": "9"}}, 422,
     "`parameters.max_new_tokens` must be an integer, got string."),
    ({"inputs": "hello", "parameters": {"max_new_tokens": 0}}, 422,
     "`parameters.max_new_tokens`: input should be greater than or equal to 1."),
    ({"inputs": "hello", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, 422,
     "`parameters.stop` may hold at most 4 strings, got 5."),
    ({"inputs": "hello", "parameters": {"grammar": {"type": "json", "value": "[1"}}}, 422,
     "`parameters.grammar` is a string that is not valid JSON."),
    ({"inputs": ""}, 422, "`inputs`: string should have at least 1 character."),
    ({"parameters": {}}, 422, "`inputs` is required (TGI's /generate; vLLM's takes `prompt`)."),
    ({"inputs": "hello", "parameters": {"adapter_id": "nope"}}, 404, "The model `nope` does not exist."),
])
async def test_refusals_are_tgi_errors(gateway: Gateway, body: dict[str, Any], status: int, message: str) -> None:
    r = await gateway.client.post("/generate", json=body)
    assert (r.status_code, r.json()) == (status, {"error": message,
                                                  "error_type": "validation" if status == 422 else "not_found"})
    assert not gateway.backend_calls.generate_requests


async def test_a_body_that_is_not_json_is_a_validation_error(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate_stream", content=b"{", headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (422, {"error": "The request body is not valid JSON.",
                                               "error_type": "validation"})
    r = await gateway.client.post("/generate_stream", content=b"{}", headers={"content-type": "text/plain"})
    assert (r.status_code, r.json()["error_type"]) == (415, "validation")


@pytest.mark.parametrize(("prompt", "status", "error_type"), [
    ("abort:INVALID_ARGUMENT:prompt: too long", 422, "validation"),
    ("busy:3", 429, "overloaded"),
    ("abort:UNAVAILABLE:engine gone", 503, "unavailable"),
    ("fail", 424, "generation"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_backend_failures(gateway: Gateway, prompt: str, status: int, error_type: str, stream: bool) -> None:
    r = await gateway.client.post("/generate", json={"inputs": prompt, "stream": stream})
    if stream and prompt == "fail":  # fails after its first token: the 200 was sent
        assert r.status_code == 200
        assert events(r.text)[-1] == {"error": f"The server had an error while processing the request (request id "
                                               f"{r.headers['x-request-id']}).", "error_type": "generation"}
        return
    assert r.status_code == status
    assert r.json()["error_type"] == error_type
    if status == 429:
        assert r.headers["retry-after"] == "3"


async def test_a_failure_mid_stream_is_an_error_event(live_gateway: Gateway) -> None:
    r = await live_gateway.client.post("/generate_stream", json={"inputs": "midfail:UNAVAILABLE"})
    assert r.status_code == 200
    got = events(r.text)
    assert got[0]["token"]["text"] == "Hel"
    assert got[1] == {"error": "The model backend is unavailable. Retry later.", "error_type": "unavailable"}
    assert len(got) == 2


async def test_timeout_is_the_requests_deadline(make_gateway: GatewayFactory) -> None:
    async with make_gateway() as gw:
        r = await gw.client.post("/infer", json={"inputs": "slow:2", "parameters": {"timeout": 0.2}})
    assert (r.status_code, r.json()) == (504, {"error": "The request timed out.", "error_type": "timeout"})
