"""MindIE's routes against the fake backend: ``/generate`` picks TGI or vLLM's legacy dialect by the body, vLLM's
answers are ``{"text": [prompt + output]}`` (streamed NUL-separated), and ``/infer`` is TGI's with MindIE's
timings; errors in the TGI shape on all of them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proto.sluice.v1 import generation_pb2
from tests.gateway.conftest import Gateway
from tests.gateway.dialects.sse import events

pytestmark = pytest.mark.anyio


async def test_a_prompt_body_is_vllms(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={
        "prompt": "hello", "max_tokens": 2, "n": 2, "temperature": 0.5, "top_k": 4, "stop_token_ids": [7],
        "ignore_eos": False, "skip_special_tokens": True, "include_stop_str_in_output": False, "seed": None,
        "stream": False, "model": "None"})
    assert r.status_code == 200
    assert r.json() == {"text": ["helloHello", "helloHello"]}
    (req,) = gateway.backend_calls.generate_requests
    assert (req.n, req.text, req.stopping.max_tokens, list(req.stopping.stop_token_ids)) == (2, "hello", 2, [7])
    assert (req.sampling.temperature, req.sampling.top_k, req.response.skip_special_tokens) == (0.5, 4, True)


async def test_vllms_token_fields_reach_the_request(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={"prompt": "hello", "truncate_prompt_tokens": 5,
                                                     "bad_words": ["world"], "allowed_token_ids": [10, 11]})
    assert r.status_code == 200, r.text
    (req,) = gateway.backend_calls.generate_requests
    assert (req.truncate_prompt_tokens, list(req.bad_words), list(req.sampling.allowed_token_ids)) == (
        5, ["world"], [10, 11])


async def test_vllms_stream_is_nul_separated_text_so_far(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={"prompt": "hi", "stream": True})
    assert r.status_code == 200
    assert r.text.endswith("\0")
    assert [json.loads(f) for f in r.text.split("\0")[:-1]] == [
        {"text": ["hiHel"]}, {"text": ["hiHello"]}, {"text": ["hiHello world"]}]


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "hi", "logprobs": 1}, "`logprobs` is not supported: the legacy /generate answer carries text only "
                                      "(use /v1/completions)."),
    ({"prompt": "hi", "detokenize": False}, "`detokenize`: only true is supported."),
    ({"prompt": [1, 2]}, "`prompt` must be a string: the answer starts with its text."),
    ({"prompt": "hi", "max_tokens": 0}, "`max_tokens`: input should be greater than or equal to 1."),
    ({"prompt": "hi", "inputs": "hi"}, "A /generate body takes `inputs` (TGI) or `prompt` (vLLM), not both."),
])
async def test_vllm_refusals_are_tgi_shaped(gateway: Gateway, body: dict[str, Any], message: str) -> None:
    r = await gateway.client.post("/generate", json=body)
    assert (r.status_code, r.json()) == (422, {"error": message, "error_type": "validation"})


async def test_vllm_backend_failure(gateway: Gateway) -> None:
    r = await gateway.client.post("/generate", json={"prompt": "busy:2"})
    assert (r.status_code, r.json()["error_type"], r.headers["retry-after"]) == (429, "overloaded", "2")


async def test_infer_is_tgis_with_mindies_timings(gateway: Gateway) -> None:
    r = await gateway.client.post("/infer", json={"inputs": "hello", "stream": False, "parameters": {
        "max_new_tokens": 20, "do_sample": False, "details": True, "seed": None, "priority": 2}})
    assert r.status_code == 200
    assert r.json()["generated_text"] == "Hello world"
    assert r.json()["details"]["finish_reason"] == "eos_token"
    req: generation_pb2.GenerateRequest = gateway.backend_calls.generate_requests[0]
    assert (req.priority, req.sampling.temperature) == (2, 0.0)
    r = await gateway.client.post("/infer", json={"inputs": "hello", "stream": True})
    got = events(r.text)
    assert [ev["token"]["text"] for ev in got] == ["Hel", "lo", " world"]
    assert got[0]["prefill_time"] >= 0 and got[0]["decode_time"] is None
    assert all(ev["prefill_time"] is None and ev["decode_time"] >= 0 for ev in got[1:])
    assert got[-1]["details"]["finish_reason"] == "eos_token"
