"""DESIGN.md §2's list of OpenAI / vLLM request fields, walked on both endpoints: each field changes
the gRPC request the gateway sends (compared with the same request without it), or the response it
returns, or is refused with a 400 naming it. None is silently ignored; unknown fields are."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gateway.conftest import Gateway
from tests.gateway.test_app import sse_data

pytestmark = pytest.mark.anyio

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ASSISTANT_LAST = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
REQUEST, RESPONSE, REFUSED = "request", "response", "refused"

# field -> {endpoint: (value, the request's other fields, what the field does)}
FIELDS: dict[str, dict[str, tuple[Any, dict[str, Any], str]]] = {
    "n": {"comp": (2, {}, REQUEST), "chat": (2, {}, REQUEST)},
    "best_of": {"comp": (2, {}, REQUEST), "chat": (2, {}, REQUEST)},
    "logprobs": {"comp": (1, {}, REQUEST), "chat": (True, {}, REQUEST)},
    "top_logprobs": {"comp": (2, {}, REFUSED), "chat": (2, {"logprobs": True}, REQUEST)},
    "echo": {"comp": (True, {}, REQUEST), "chat": (True, {"messages": ASSISTANT_LAST}, RESPONSE)},
    "stop": {"comp": (["x"], {}, REQUEST), "chat": ("x", {}, REQUEST)},
    "seed": {"comp": (1, {}, REQUEST), "chat": (1, {}, REQUEST)},
    "response_format": {"comp": ({"type": "json_object"}, {}, REQUEST),
                        "chat": ({"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}, {}, REQUEST)},
    "tools": {"comp": ([TOOL], {}, REFUSED), "chat": ([TOOL], {}, REQUEST)},
    "tool_choice": {"comp": ("auto", {}, REFUSED), "chat": ("required", {"tools": [TOOL]}, REQUEST)},
    "top_k": {"comp": (5, {}, REQUEST), "chat": (5, {}, REQUEST)},
    "min_p": {"comp": (0.1, {}, REQUEST), "chat": (0.1, {}, REQUEST)},
    "repetition_penalty": {"comp": (1.1, {}, REQUEST), "chat": (1.1, {}, REQUEST)},
    "ignore_eos": {"comp": (True, {}, REQUEST), "chat": (True, {}, REQUEST)},
    "min_tokens": {"comp": (1, {}, REQUEST), "chat": (1, {}, REQUEST)},
    "stop_token_ids": {"comp": ([5], {}, REQUEST), "chat": ([5], {}, REQUEST)},
    "skip_special_tokens": {"comp": (False, {}, REQUEST), "chat": (False, {}, REQUEST)},
    "guided_json": {"comp": ({"type": "object"}, {}, REQUEST), "chat": ('{"type": "object"}', {}, REQUEST)},
    "guided_regex": {"comp": ("[0-9]+", {}, REQUEST), "chat": ("[0-9]+", {}, REQUEST)},
    "guided_choice": {"comp": (["a", "b"], {}, REQUEST), "chat": (["a", "b"], {}, REQUEST)},
    "guided_grammar": {"comp": ('root ::= "a"', {}, REQUEST), "chat": ('root ::= "a"', {}, REQUEST)},
    "use_beam_search": {"comp": (True, {}, REQUEST), "chat": (True, {}, REQUEST)},
    "length_penalty": {"comp": (0.5, {"use_beam_search": True}, REQUEST), "chat": (0.5, {}, REFUSED)},
    "prompt_logprobs": {"comp": (1, {}, REQUEST), "chat": (1, {}, REQUEST)},
    "priority": {"comp": (3, {}, REQUEST), "chat": (-3, {}, REQUEST)},
    "stream_options.include_usage": {"comp": (True, {"stream": True}, RESPONSE),
                                     "chat": (True, {"stream": True}, RESPONSE)},
}
DESIGN_FIELDS = ("n, best_of, logprobs, top_logprobs, echo, stop, seed, response_format, tools, tool_choice, top_k, "
                 "min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens, guided_json, "
                 "guided_regex, guided_choice, guided_grammar, use_beam_search, length_penalty, prompt_logprobs, "
                 "priority").split(", ")
WALK = [(name, endpoint) for name in FIELDS for endpoint in ("comp", "chat")]


def test_the_walk_covers_design_section_2() -> None:
    assert list(FIELDS) == [*DESIGN_FIELDS, "stream_options.include_usage"]


def _body(endpoint: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if endpoint == "comp":
        return "/v1/completions", {"prompt": "hello", **fields}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **fields}


def _with(name: str, value: Any) -> dict[str, Any]:
    if name == "stream_options.include_usage":
        return {"stream_options": {"include_usage": value}}
    return {name: value}


def _answer(r: Any) -> object:
    """The response without what differs between any two calls (ids, timestamps)."""
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(d) if d != "[DONE]" else d for d in sse_data(r.text)]
        return [{k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
                for e in events]
    return {k: v for k, v in r.json().items() if k not in ("id", "created")}


@pytest.mark.parametrize(("name", "endpoint"), WALK, ids=[f"{n}-{e}" for n, e in WALK])
async def test_no_field_is_silently_ignored(gateway: Gateway, name: str, endpoint: str) -> None:
    value, base, effect = FIELDS[name][endpoint]
    path, without = _body(endpoint, base)
    _, with_field = _body(endpoint, {**base, **_with(name, value)})
    sent = gateway.backend_calls.generate_requests
    r0 = await gateway.client.post(path, json=without)
    assert r0.status_code == 200, r0.text
    r1 = await gateway.client.post(path, json=with_field)
    if effect == REFUSED:
        assert r1.status_code == 400, r1.text
        assert r1.json()["error"]["param"] == name and f"`{name}`" in r1.json()["error"]["message"]
        assert len(sent) == 1
        return
    assert r1.status_code == 200, r1.text
    before, after = sent
    before.request_id = after.request_id = ""  # generated per HTTP request
    if effect == REQUEST:
        assert after != before
    else:
        assert after == before and _answer(r1) != _answer(r0)


async def test_unknown_fields_are_ignored_but_known_ones_kept(gateway: Gateway) -> None:
    known = {"guided_regex": "[a-z]+", "priority": 2, "top_k": 3, "seed": 4}
    for extra in ({}, {"metadata": {"k": "v"}, "store": False, "x_custom": [1]}):
        r = await gateway.client.post("/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}], **known, **extra})
        assert r.status_code == 200, r.text
    plain, with_unknown = gateway.backend_calls.generate_requests
    plain.request_id = with_unknown.request_id = ""
    assert with_unknown == plain
    assert (plain.guided.regex, plain.priority, plain.sampling.top_k, plain.sampling.seed) == ("[a-z]+", 2, 3, 4)
