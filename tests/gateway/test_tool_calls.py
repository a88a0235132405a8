"""Tool calls and structured outputs in responses: the JSON body, the streamed deltas byte for byte,
and the official ``openai`` SDK reading them (its stream helpers and ``parse``)."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from tests.gateway.conftest import SERVED, Gateway
from tests.gateway.fakes import JSON_ANSWER
from tests.gateway.test_app import sse_data

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
CALLS = [
    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]


def tool_request(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": "toolcalls"}], "tools": TOOLS, **fields}


async def test_tool_calls_in_the_message(gateway: Gateway) -> None:
    r = await gateway.client.post(CHAT, json=tool_request(tool_choice="auto"))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": CALLS},
                      "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}
    (sent,) = gateway.backend_calls.generate_requests
    assert [(t.name, json.loads(t.parameters)) for t in sent.chat.tools] == [("get_weather", CITY),
                                                                            ("get_time", {"type": "object"})]
    assert sent.tool_choice.auto


async def test_tool_calls_stream_as_openai_deltas(gateway: Gateway) -> None:
    r = await gateway.client.post(CHAT, json=tool_request(stream=True))
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ({"role": "assistant", "content": ""}, None),
        ({"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": '}}]}, None),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, None),
        ({"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                          "function": {"name": "get_time", "arguments": "{}"}}]}, "tool_calls"),
    ]


async def test_openai_sdk_reassembles_streamed_tool_calls(live_gateway: Gateway) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{live_gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        whole = await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "toolcalls"}],
                                                     tools=TOOLS)
        message = whole.choices[0].message
        assert message.content is None and whole.choices[0].finish_reason == "tool_calls"
        assert [c.model_dump() for c in message.tool_calls or []] == CALLS

        # By hand, as OpenAI's docs accumulate deltas.
        stream = await client.chat.completions.create(model=SERVED, tools=TOOLS, stream=True,
                                                      messages=[{"role": "user", "content": "toolcalls"}])
        calls: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or "" if delta.function else ""
                call["arguments"] += delta.function.arguments or "" if delta.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [calls[i] for i in sorted(calls)] == [
            {"id": c["id"], **c["function"]} for c in CALLS]  # type: ignore[dict-item]

        # With the SDK's own stream helper.
        async with client.beta.chat.completions.stream(
                model=SERVED, tools=TOOLS, messages=[{"role": "user", "content": "toolcalls"}]) as helper:
            final = await helper.get_final_completion()
        assert [c.model_dump(include={"id", "type", "function"}) for c in final.choices[0].message.tool_calls or []
                ] == [{**c, "function": {**c["function"], "parsed_arguments": None}} for c in CALLS]
    finally:
        await client.close()


class Person(pydantic.BaseModel):
    name: str
    age: int


async def test_openai_sdk_parse_with_a_pydantic_model(live_gateway: Gateway) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{live_gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        completion = await client.beta.chat.completions.parse(
            model=SERVED, messages=[{"role": "user", "content": "json"}], response_format=Person)
        assert completion.choices[0].message.parsed == Person(**JSON_ANSWER)
        (sent,) = live_gateway.backend_calls.generate_requests
        schema = json.loads(sent.guided.json_schema)
        assert schema["properties"] == {"name": {"title": "Name", "type": "string"},
                                        "age": {"title": "Age", "type": "integer"}}
        assert schema["required"] == ["name", "age"] and schema["additionalProperties"] is False
    finally:
        await client.close()
