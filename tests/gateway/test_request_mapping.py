"""Each request field of issue 22 becomes the exact ``sluice.v1.GenerateRequest``: the body is parsed
(``gateway/schemas.py``) and converted (``generate_request_to_pb``), and the message is compared whole
with the one written out here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.client import generate_request_to_pb
from gateway.schemas import parse_chat, parse_completion
from proto.sluice.v1 import common_pb2, generation_pb2

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": CITY}}
Req = generation_pb2.GenerateRequest


def built(body: dict[str, Any], *, chat: bool) -> Req:
    req = parse_chat(body, max_n=16) if chat else parse_completion(body, max_n=16)
    (prompt,) = req.prompts
    return generate_request_to_pb(prompt, req.params, "rid")


def baseline(chat: bool) -> Req:
    """What a request without the field is sent as."""
    if chat:
        return Req(request_id="rid", n=1, chat=generation_pb2.Chat(
            messages=[generation_pb2.ChatMessage(role="user", content="hi")], add_generation_prompt=True),
            stopping=generation_pb2.StoppingCriteria(), response=generation_pb2.ResponseOptions())
    return Req(request_id="rid", n=1, text="hello", stopping=generation_pb2.StoppingCriteria(max_tokens=16),
               response=generation_pb2.ResponseOptions())


@dataclass
class Case:
    id: str
    chat: bool
    fields: dict[str, Any]
    expect: Callable[[Req], None]  # turns the baseline into the expected request


def _guided(**kind: Any) -> Callable[[Req], None]:
    def apply(r: Req) -> None:
        r.guided.CopyFrom(common_pb2.GuidedDecoding(**kind))
    return apply


def _set(**fields: Any) -> Callable[[Req], None]:
    def apply(r: Req) -> None:
        for name, value in fields.items():
            target = r
            *path, last = name.split(".")
            for part in path:
                target = getattr(target, part)
            setattr(target, last, value)
    return apply


def _all(*steps: Callable[[Req], None]) -> Callable[[Req], None]:
    def apply(r: Req) -> None:
        for step in steps:
            step(r)
    return apply


def _tools(r: Req) -> None:
    r.chat.tools.add(name="get_weather", description="Weather of a city",
                     parameters=json.dumps(WEATHER["function"]["parameters"]))


def _tools_and(**fields: Any) -> Callable[[Req], None]:
    return _all(_tools, _set(**fields))


def _history(r: Req) -> None:
    del r.chat.messages[:]
    r.chat.messages.add(role="user", content="weather?")
    call = r.chat.messages.add(role="assistant", content="")
    call.tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    r.chat.messages.add(role="tool", content="sunny", tool_call_id="call_1")


def _beam(width: int, length_penalty: float | None = None,
          stopping: int = common_pb2.BEAM_STOPPING_UNSPECIFIED) -> Callable[[Req], None]:
    def apply(r: Req) -> None:
        r.beam_search.beam_width = width
        r.beam_search.early_stopping = stopping  # type: ignore[assignment]
        if length_penalty is not None:
            r.beam_search.length_penalty = length_penalty
    return apply


CASES = [
    Case("response-format-json-schema", True,
         {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
         _guided(json_schema=SCHEMA_TEXT)),
    Case("response-format-json-object", True, {"response_format": {"type": "json_object"}},
         _guided(json_object=True)),
    Case("response-format-text", True, {"response_format": {"type": "text"}}, lambda r: None),
    Case("response-format-in-completions", False, {"response_format": {"type": "json_object"}},
         _guided(json_object=True)),
    Case("guided-json-object", False, {"guided_json": SCHEMA}, _guided(json_schema=SCHEMA_TEXT)),
    Case("guided-json-string", True, {"guided_json": json.dumps(SCHEMA, indent=2)},
         _guided(json_schema=SCHEMA_TEXT)),
    Case("guided-regex", False, {"guided_regex": "[a-z]+"}, _guided(regex="[a-z]+")),
    Case("guided-choice", True, {"guided_choice": ["yes", "no"]},
         _guided(choice=common_pb2.Choices(choices=["yes", "no"]))),
    Case("guided-grammar", False, {"guided_grammar": 'root ::= "a"'}, _guided(grammar='root ::= "a"')),
    Case("guided-backend-llguidance", False, {"guided_regex": "x", "guided_decoding_backend": "llguidance"},
         _guided(regex="x")),
    Case("structured-outputs-json", True, {"structured_outputs": {"json": SCHEMA}}, _guided(json_schema=SCHEMA_TEXT)),
    Case("structured-outputs-regex", False, {"structured_outputs": {"regex": "\\d+"}}, _guided(regex="\\d+")),
    Case("structured-outputs-choice", False, {"structured_outputs": {"choice": ["a"]}},
         _guided(choice=common_pb2.Choices(choices=["a"]))),
    Case("structured-outputs-grammar", True, {"structured_outputs": {"grammar": "start: \"a\""}},
         _guided(grammar="start: \"a\"")),
    Case("structured-outputs-json-object", True, {"structured_outputs": {"json_object": True, "regex": None}},
         _guided(json_object=True)),
    Case("tools", True, {"tools": [WEATHER]}, _tools),
    Case("tool-choice-none", True, {"tools": [WEATHER], "tool_choice": "none"},
         _tools_and(**{"tool_choice.none": True})),
    Case("tool-choice-auto", True, {"tools": [WEATHER], "tool_choice": "auto"},
         _tools_and(**{"tool_choice.auto": True})),
    Case("tool-choice-required", True, {"tools": [WEATHER], "tool_choice": "required"},
         _tools_and(**{"tool_choice.required": True})),
    Case("tool-choice-named", True,
         {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         _tools_and(**{"tool_choice.function_name": "get_weather"})),
    Case("parallel-tool-calls", True, {"tools": [WEATHER], "parallel_tool_calls": False},
         _tools_and(parallel_tool_calls=False)),
    Case("tool-call-history", True, {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "call_1"}]}, _history),
    Case("chat-template", True, {"chat_template": "{{ messages }}"}, _set(**{"chat.chat_template": "{{ messages }}"})),
    Case("chat-template-kwargs", True, {"chat_template_kwargs": {"enable_thinking": False}},
         _set(**{"chat.chat_template_kwargs": '{"enable_thinking": false}'})),
    Case("best-of", False, {"best_of": 3, "n": 2}, _set(best_of=3, n=2)),
    Case("best-of-equal-to-n", False, {"best_of": 2, "n": 2}, _set(n=2)),  # nothing more to choose from
    Case("beam-search", False, {"use_beam_search": True, "n": 2}, _all(_set(n=2), _beam(2))),
    Case("beam-search-best-of-is-the-width", True, {"use_beam_search": True, "best_of": 4, "temperature": 0},
         _all(_set(**{"sampling.temperature": 0.0}), _beam(4))),
    Case("beam-search-length-penalty-early", False,
         {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True},
         _beam(1, 0.5, common_pb2.BEAM_STOPPING_EARLY)),
    Case("beam-search-never", False, {"use_beam_search": True, "early_stopping": "never"},
         _beam(1, None, common_pb2.BEAM_STOPPING_NEVER)),
    Case("length-penalty-default-without-beams", False, {"length_penalty": 1.0, "early_stopping": False},
         lambda r: None),
    Case("prompt-logprobs", False, {"prompt_logprobs": 3}, _set(**{"response.prompt_logprobs": 3})),
    Case("prompt-logprobs-zero", True, {"prompt_logprobs": 0}, _set(**{"response.prompt_logprobs": 0})),
    Case("priority", True, {"priority": -5}, _set(priority=-5)),
    Case("echo", False, {"echo": True}, _set(**{"response.echo": True})),
    Case("chat-echo-stays-in-the-gateway", True, {"echo": True}, lambda r: None),
    Case("truncate-prompt-tokens", False, {"truncate_prompt_tokens": 8}, _set(truncate_prompt_tokens=8)),
    Case("add-special-tokens-chat", True, {"add_special_tokens": True}, _set(add_special_tokens=True)),
    Case("add-special-tokens-text", False, {"add_special_tokens": False}, _set(add_special_tokens=False)),
    Case("allowed-token-ids", True, {"allowed_token_ids": [3, 9]},
         lambda r: r.sampling.allowed_token_ids.extend([3, 9])),
    Case("include-reasoning-stays-in-the-gateway", True, {"include_reasoning": False}, lambda r: None),
    Case("spaces-between-special-tokens-true-is-what-happens", True, {"spaces_between_special_tokens": True},
         lambda r: None),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_field_becomes_the_exact_request(case: Case) -> None:
    body = {"messages": USER, **case.fields} if case.chat else {"prompt": "hello", **case.fields}
    expected = baseline(case.chat)
    case.expect(expected)
    assert built(body, chat=case.chat) == expected


def test_baseline_is_what_a_bare_request_sends() -> None:
    assert built({"messages": USER}, chat=True) == baseline(True)
    assert built({"prompt": "hello"}, chat=False) == baseline(False)


def test_chat_echo_is_the_last_assistant_message() -> None:
    turns = [*USER, {"role": "assistant", "content": "The answer is"}]
    assert parse_chat({"messages": turns, "echo": True}, max_n=16).echo_prefix == "The answer is"
    assert parse_chat({"messages": turns}, max_n=16).echo_prefix == ""
    assert parse_chat({"messages": USER, "echo": True}, max_n=16).echo_prefix == ""  # nothing to continue
