"""Echo and log probabilities: the formats of ``gateway/logprobs.py``, and what clients get over HTTP."""

from __future__ import annotations

import json

import pytest

from gateway.backend import PromptTokenLogprob, TokenLogprob, TopLogprob
from gateway.logprobs import completion_logprobs, vllm_prompt_logprobs
from tests.gateway.conftest import Gateway
from tests.gateway.test_app import sse_data

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


def test_vllm_prompt_logprobs_ranks() -> None:
    prompt = (
        PromptTokenLogprob(1, "a", None),
        PromptTokenLogprob(2, " b", -0.5, (TopLogprob(9, "x", b"x", -0.1), TopLogprob(2, " b", b" b", -0.5))),
        PromptTokenLogprob(3, " c", -3.0, (TopLogprob(9, "x", b"x", -0.2),)),
    )
    assert vllm_prompt_logprobs(prompt) == [
        None,
        {"2": {"logprob": -0.5, "rank": 2, "decoded_token": " b"},
         "9": {"logprob": -0.1, "rank": 1, "decoded_token": "x"}},
        {"3": {"logprob": -3.0, "rank": 2, "decoded_token": " c"},  # not among the alternatives: after them
         "9": {"logprob": -0.2, "rank": 1, "decoded_token": "x"}},
    ]


def test_completion_logprobs_put_the_echoed_prompt_first() -> None:
    prompt = (PromptTokenLogprob(1, "Hi", None), PromptTokenLogprob(2, " you", -1.5, (TopLogprob(7, "!", b"!", -0.5),)))
    out = completion_logprobs([TokenLogprob(5, " there", b" there", -0.25)], 10, prompt)
    assert out == {"tokens": ["Hi", " you", " there"], "token_logprobs": [None, -1.5, -0.25],
                   "top_logprobs": [None, {" you": -1.5, "!": -0.5}, {" there": -0.25}],
                   "text_offset": [10, 12, 16]}


anyio = pytest.mark.anyio


@anyio
async def test_completion_echo_prefixes_the_text(gateway: Gateway) -> None:
    r = await gateway.client.post(COMP, json={"prompt": ["a b", "c"], "echo": True})
    assert [c["text"] for c in r.json()["choices"]] == ["a bHello world", "cHello world"]
    assert all(sent.response.echo for sent in gateway.backend_calls.generate_requests)


@anyio
async def test_completion_echo_with_logprobs(gateway: Gateway) -> None:
    r = await gateway.client.post(COMP, json={"prompt": "a b", "echo": True, "logprobs": 1})
    (choice,) = r.json()["choices"]
    assert choice["text"] == "a bHello world"
    assert choice["logprobs"] == {
        "tokens": ["a", " b", "Hel", "lo", " world"],
        "token_logprobs": [None, -0.25, -0.5, -0.5, -0.5],
        "top_logprobs": [None, {" b": -0.25, "p0": -1.0}, {"Hel": -0.5, "alt0": -1.0}, {"lo": -0.5, "alt0": -1.0},
                         {" world": -0.5, "alt0": -1.0}],
        "text_offset": [0, 1, 3, 6, 8],
    }
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for


@anyio
async def test_completion_echo_with_logprobs_streamed(gateway: Gateway) -> None:
    r = await gateway.client.post(COMP, json={"prompt": "a b", "echo": True, "logprobs": 0, "stream": True})
    chunks = [json.loads(d)["choices"][0] for d in sse_data(r.text)[:-1]]
    assert [(c["text"], c["logprobs"]["tokens"], c["logprobs"]["text_offset"]) for c in chunks] == [
        ("a bHel", ["a", " b", "Hel"], [0, 1, 3]), ("lo", ["lo"], [6]), (" world", [" world"], [8])]
    assert chunks[0]["logprobs"]["token_logprobs"] == [None, -0.25, -0.5]


@anyio
async def test_logprobs_without_echo_leave_the_prompt_out(gateway: Gateway) -> None:
    r = await gateway.client.post(COMP, json={"prompt": "a b", "logprobs": 0, "prompt_logprobs": 0})
    (choice,) = r.json()["choices"]
    assert choice["text"] == "Hello world"
    assert choice["logprobs"]["tokens"] == ["Hel", "lo", " world"]
    assert choice["prompt_logprobs"] == [None, {"2": {"logprob": -0.25, "rank": 1, "decoded_token": " b"}}]


@anyio
async def test_completion_prompt_logprobs_vllm_format(gateway: Gateway) -> None:
    r = await gateway.client.post(COMP, json={"prompt": "a b", "prompt_logprobs": 2, "n": 2})
    for choice in r.json()["choices"]:
        assert choice["logprobs"] is None
        assert choice["prompt_logprobs"] == [None, {
            "2": {"logprob": -0.25, "rank": 3, "decoded_token": " b"},
            "200": {"logprob": -1.0, "rank": 1, "decoded_token": "p0"},
            "201": {"logprob": -2.0, "rank": 2, "decoded_token": "p1"}}]
    (sent,) = gateway.backend_calls.generate_requests
    assert sent.response.HasField("prompt_logprobs") and sent.response.prompt_logprobs == 2


@anyio
async def test_chat_prompt_logprobs_on_the_response(gateway: Gateway) -> None:
    r = await gateway.client.post(CHAT, json={"messages": [{"role": "user", "content": "x y"}], "prompt_logprobs": 0})
    body = r.json()
    assert body["prompt_logprobs"] == [None, {"2": {"logprob": -0.25, "rank": 1, "decoded_token": " y"}}]
    assert "prompt_logprobs" not in body["choices"][0]


@anyio
async def test_chat_echo_repeats_the_assistant_turn(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My pick: "}]
    r = await gateway.client.post(CHAT, json={"messages": messages, "echo": True, "add_generation_prompt": False})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "My pick: Hello world"}
    (sent,) = gateway.backend_calls.generate_requests
    assert not sent.response.echo  # the service would echo the whole rendered prompt
    r = await gateway.client.post(CHAT, json={"messages": messages, "echo": True, "stream": True, "n": 2})
    deltas = [json.loads(d)["choices"][0] for d in sse_data(r.text)[:-1]]
    assert [(d["index"], d["delta"]) for d in deltas[:4]] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
        (0, {"content": "My pick: "}), (1, {"content": "My pick: "})]
    r = await gateway.client.post(CHAT, json={"messages": messages[:1], "echo": True})
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"  # no assistant turn to echo
