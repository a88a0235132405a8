"""services/tokenizer/chat.py: a public Chat (tools, assistant calls, tool results, template variables)
rendered as transformers renders the same conversation."""

from __future__ import annotations

import json

import pytest

from common.errors import InvalidRequestError
from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import generation_pb2
from services.tokenizer.chat import render_chat
from tests.engine.text.test_chat import QWEN25_TEMPLATE, WEATHER_TOOL, qwen_reference, tool_turns

PARAMS = WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path())


def weather_chat(**kw: object) -> generation_pb2.Chat:
    arguments = json.dumps({"location": "Paris, France", "unit": "celsius"})
    return generation_pb2.Chat(
        messages=[generation_pb2.ChatMessage(role="user", content="Weather in Paris?"),
                  generation_pb2.ChatMessage(role="assistant", tool_calls=[generation_pb2.ToolCall(
                      id="call_1", name="get_current_weather", arguments=arguments)]),
                  generation_pb2.ChatMessage(role="tool", tool_call_id="call_1",
                                             content='{"temperature": 21, "unit": "celsius"}')],
        tools=[generation_pb2.Tool(name="get_current_weather", description="Current weather in a city",
                                   parameters=json.dumps(PARAMS))], **kw)


def test_tools_and_tool_turns_render_as_transformers(smollm: Tokenizer) -> None:
    expected = qwen_reference(smollm).apply_chat_template(
        tool_turns({"location": "Paris, France", "unit": "celsius"}), tools=[WEATHER_TOOL], tokenize=False,
        add_generation_prompt=True)
    assert render_chat(smollm, weather_chat(chat_template=QWEN25_TEMPLATE)) == expected
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in expected


def test_the_request_template_wins_over_the_services_which_wins_over_the_models(smollm: Tokenizer) -> None:
    service = Tokenizer(smollm.backend, chat_template="service:{{ messages[0].content }}")
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="q")])
    assert render_chat(service, chat) == "service:q"
    chat.chat_template = "request:{{ messages[0].content }}"
    assert render_chat(service, chat) == "request:q"


def test_chat_template_kwargs_are_template_variables(smollm: Tokenizer) -> None:
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="q")],
                               chat_template="{{ 'think' if enable_thinking else 'direct' }}:{{ tools }}",
                               chat_template_kwargs='{"enable_thinking": false}')
    assert render_chat(smollm, chat) == "direct:None"
    chat.chat_template_kwargs = '{"enable_thinking": true}'
    assert render_chat(smollm, chat) == "think:None"


@pytest.mark.parametrize("kwargs, fragment", [
    ("[1]", "must be a JSON object"),
    ("{", "is not JSON"),
    ('{"messages": [], "tools": 1}', "may not set messages, tools"),
])
def test_bad_chat_template_kwargs_are_refused(smollm: Tokenizer, kwargs: str, fragment: str) -> None:
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="q")],
                               chat_template_kwargs=kwargs)
    with pytest.raises(InvalidRequestError) as info:
        render_chat(smollm, chat)
    assert info.value.field == "chat_template_kwargs" and fragment in info.value.message


def test_assistant_call_arguments_that_are_not_json_name_the_message(smollm: Tokenizer) -> None:
    chat = weather_chat(chat_template=QWEN25_TEMPLATE)
    chat.messages[1].tool_calls[0].arguments = '{"location": '
    with pytest.raises(InvalidRequestError) as info:
        render_chat(smollm, chat)
    assert info.value.field == "messages"
    assert info.value.message.startswith("messages[1].tool_calls[0].function.arguments is not valid JSON")
