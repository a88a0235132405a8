"""gateway/responses_api/request.py: a Responses body as the chat body it runs as, and what is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import ApiError
from gateway.responses_api.request import parse_responses, responses_param

FN = {"type": "function", "name": "get_weather", "description": "Weather now",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat_of(body: dict[str, Any], history: tuple[dict[str, object], ...] = ()) -> dict[str, object]:
    return parse_responses(body, history).chat_body


def refusal(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_responses(body, ())
    assert info.value.status == 400
    return info.value


def test_text_input_and_instructions_become_a_system_and_a_user_turn() -> None:
    assert chat_of({"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 7,
                    "temperature": 0.5, "stream": True}) == {
        "model": "m", "temperature": 0.5, "stream": True, "max_completion_tokens": 7,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}


def test_items_become_turns_and_parallel_calls_share_one_assistant_turn() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "21C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "25C"}]},
    ]
    assert chat_of({"input": items})["messages"] == [
        {"role": "user", "content": "Weather ?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"},
        {"role": "tool", "tool_call_id": "c2", "content": "25C"},
    ]


def test_function_tools_and_tool_choice_become_chat_s() -> None:
    chat = chat_of({"input": "x", "tools": [FN], "tool_choice": {"type": "function", "name": "get_weather"},
                    "parallel_tool_calls": False})
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in FN.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat_of({"input": "x", "tools": [FN], "tool_choice": "required"})["tool_choice"] == "required"


def test_history_comes_first_and_instructions_are_not_carried_over() -> None:
    history: tuple[dict[str, object], ...] = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})
    call = parse_responses({"input": "c", "instructions": "New."}, history)
    assert call.chat_body["messages"] == [{"role": "system", "content": "New."}, *history,
                                          {"role": "user", "content": "c"}]
    assert call.new_messages == (*history, {"role": "user", "content": "c"})


def test_text_format_becomes_response_format() -> None:
    schema = {"type": "object"}
    chat = chat_of({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert "response_format" not in chat_of({"input": "x", "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
         "input[0].content[0].file_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
])
def test_unsupported_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    err = refusal({"input": "x", **body})
    assert err.param == param, err.message


def test_off_values_of_refused_fields_pass() -> None:
    chat_of({"input": "x", "background": False, "include": [], "truncation": "disabled", "reasoning": None})


def test_chat_s_field_names_are_spelled_as_the_responses_request_s() -> None:
    assert [responses_param(p) for p in ("tools[3].function.parameters", "max_completion_tokens",
                                         "response_format.json_schema.schema", "response_format", "messages[1]",
                                         None)] == [
        "tools[3].parameters", "max_output_tokens", "text.format.schema", "text.format", "messages[1]", None]
