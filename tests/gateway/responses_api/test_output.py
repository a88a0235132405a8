"""gateway/responses_api/output.py: the Response object and the stream's events, in OpenAI's order, each checked
against the ``openai`` package's own models."""

from __future__ import annotations

from typing import Any

import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from gateway.backend import Delta, FinishReason, ToolCallDelta, Usage
from gateway.responses_api.output import ResponseBuilder
from gateway.responses_api.request import parse_responses

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def build(body: dict[str, Any], deltas: list[Delta],
          usage: Usage | None = None) -> tuple[ResponseBuilder, list[dict[str, object]]]:
    b = ResponseBuilder(parse_responses({"input": "hi", **body}, ()), "resp_abc", "m")
    events = b.opening()
    for d in deltas:
        events += b.add(d)
    events += b.closing(usage or Usage())
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return b, events


def kinds(events: list[dict[str, object]]) -> list[object]:
    return [e["type"] for e in events]


def test_text_answer_events_and_response() -> None:
    b, events = build({"instructions": "Be brief."},
                      [Delta(0, text="Hel"), Delta(0, text="lo", finish_reason=FinishReason.EOS)], Usage(4, 2, 1))
    assert kinds(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello" and final.instructions == "Be brief."
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens,
                                        final.usage.input_tokens_details.cached_tokens) == (4, 2, 1)
    created = Response.model_validate(events[0]["response"])
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert Response.model_validate(b.finish(Usage(4, 2, 1))) == final


def test_thinking_then_answer_then_calls() -> None:
    _, events = build({"tools": [FN]}, [
        Delta(0, reasoning_content="Think"), Delta(0, text="Ok."),
        Delta(0, tool_calls=(ToolCallDelta(0, "call_a", "get_weather", '{"city": '),)),
        Delta(0, tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),)),
        Delta(0, tool_calls=(ToolCallDelta(1, "call_b", "get_weather", "{}"),), finish_reason=FinishReason.TOOL_CALLS)])
    assert kinds(events)[2:] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    final = Response.model_validate(events[-1]["response"])
    reasoning, message, first, second = final.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "Think"
    assert message.type == "message" and message.content[0].type == "output_text"
    assert message.content[0].text == "Ok."
    assert first.type == "function_call" and (first.call_id, first.name, first.arguments) == (
        "call_a", "get_weather", '{"city": "Paris"}')
    assert second.type == "function_call" and (second.call_id, second.arguments) == ("call_b", "{}")
    assert final.tools[0].type == "function" and final.tools[0].name == "get_weather"


def test_cut_by_max_output_tokens_is_incomplete() -> None:
    _, events = build({"max_output_tokens": 1}, [Delta(0, text="Hel", finish_reason=FinishReason.LENGTH)])
    assert events[-1]["type"] == "response.incomplete"
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"


def test_conversation_is_the_input_then_the_output_as_chat_turns() -> None:
    b, _ = build({}, [Delta(0, text="Hm."), Delta(0, tool_calls=(ToolCallDelta(0, "c", "f", "{}"),))])
    assert b.conversation() == (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hm.",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
