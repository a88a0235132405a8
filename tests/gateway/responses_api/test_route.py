"""``POST /v1/responses`` through the gateway, on the fake backend: the request the backend gets, the body and the
stream the official ``openai`` SDK reads, ``previous_response_id``, and the errors."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai.types.responses import Response

from tests.gateway.conftest import API_KEY, SERVED, Gateway, GatewayFactory

pytestmark = pytest.mark.anyio

RESPONSES = "/v1/responses"
FN: Any = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def sdk(gateway: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                              http_client=gateway.client)  # type: ignore[arg-type]  # httpx2's stubs name httpx


def turns(gateway: Gateway, call: int = -1) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in gateway.backend_calls.generate_requests[call].chat.messages]


async def test_a_text_answer(gateway: Gateway) -> None:
    r = await gateway.client.post(RESPONSES, json={"model": SERVED, "input": "hi", "instructions": "Be brief.",
                                                   "max_output_tokens": 5})
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())
    assert (response.status, response.output_text, response.model) == ("completed", "Hello world", SERVED)
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    assert turns(gateway) == [("system", "Be brief."), ("user", "hi")]
    assert response.usage is not None  # the fake: 3 prompt tokens a turn and a token a word, 3 output tokens
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (9, 3, 12)
    assert gateway.backend_calls.generate_requests[0].stopping.max_tokens == 5


async def test_the_sdk_stream_has_openai_s_event_sequence(gateway: Gateway) -> None:
    stream = await sdk(gateway).responses.create(model=SERVED, input="hi", stream=True)
    events = [e async for e in stream]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello world"


async def test_function_calls_as_output_items(gateway: Gateway) -> None:
    response = await sdk(gateway).responses.create(model=SERVED, input="toolcalls", tools=[FN],
                                                   tool_choice="auto")
    assert [(o.type, getattr(o, "call_id", None), getattr(o, "arguments", None)) for o in response.output] == [
        ("function_call", "call_0", '{"city": "Paris"}'), ("function_call", "call_1", "{}")]
    sent = gateway.backend_calls.generate_requests[0]
    assert [t.name for t in sent.chat.tools] == ["get_weather"] and sent.tool_choice.auto


async def test_previous_response_id_continues_the_conversation(gateway: Gateway) -> None:
    client = sdk(gateway)
    first = await client.responses.create(model=SERVED, input="hi", instructions="Old.")
    second = await client.responses.create(model=SERVED, input="again", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert turns(gateway) == [("user", "hi"), ("assistant", "Hello world"), ("user", "again")]
    third = await client.responses.create(model=SERVED, input="more", previous_response_id=second.id)
    assert turns(gateway)[-2:] == [("assistant", "Hello world"), ("user", "more")] and len(turns(gateway)) == 5
    unstored = await client.responses.create(model=SERVED, input="hi", store=False)
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model=SERVED, input="x", previous_response_id=unstored.id)
    assert info.value.body == {"message": f"Previous response with id '{unstored.id}' not found.",
                               "type": "invalid_request_error", "param": "previous_response_id",
                               "code": "previous_response_not_found"}
    assert third.status == "completed"


async def test_a_streamed_response_is_stored_too(gateway: Gateway) -> None:
    client = sdk(gateway)
    events = [e async for e in await client.responses.create(model=SERVED, input="hi", stream=True)]
    assert events[-1].type == "response.completed"
    await client.responses.create(model=SERVED, input="again", previous_response_id=events[-1].response.id)
    assert turns(gateway)[-2:] == [("assistant", "Hello world"), ("user", "again")]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"background": True}, 400, "background"),
    ({"tools": [{"type": "file_search"}]}, 400, "tools[0].type"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"model": "nope"}, 404, "model"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, 400, "tools[0].parameters"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "abort:INVALID_ARGUMENT:messages: too long"}, 400, "messages"),
])
async def test_errors_are_openai_s_error_bodies(gateway: Gateway, body: dict[str, Any], status: int,
                                                param: str) -> None:
    r = await gateway.client.post(RESPONSES, json={"model": SERVED, "input": "hi", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


async def test_a_failure_mid_stream_is_an_error_event(gateway: Gateway) -> None:
    r = await gateway.client.post(RESPONSES, json={"model": SERVED, "input": "midfail:UNAVAILABLE", "stream": True})
    assert r.status_code == 200
    frames = r.text.split("\n\n")[:-1]
    assert frames[-1].startswith("event: error\ndata: ")
    assert '"code":"backend_unavailable"' in frames[-1]
    assert "data: [DONE]" not in r.text


async def test_the_agents_sdk_calls_the_tools_and_answers(gateway: Gateway) -> None:
    """The fake calls get_weather and get_time for "toolcalls"; the turn after, whose last message is a tool's
    output, it answers "Hello world"."""
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        called.append(f"weather {city}")
        return "21C"

    @function_tool
    def get_time() -> str:
        called.append("time")
        return "noon"

    agent = Agent(name="a", instructions="Use the tools.", tools=[get_weather, get_time],
                  model=OpenAIResponsesModel(model=SERVED, openai_client=sdk(gateway)),
                  model_settings=ModelSettings(tool_choice="auto"))
    result = await Runner.run(agent, "toolcalls", max_turns=3)
    assert result.final_output == "Hello world"
    assert called == ["weather Paris", "time"]
    assert turns(gateway)[-3:] == [("assistant", ""), ("tool", "21C"), ("tool", "noon")]


async def test_a_chat_field_s_error_names_the_responses_field(gateway: Gateway) -> None:
    r = await gateway.client.post(RESPONSES, json={"input": "hi", "tools": [{"type": "function", "name": "f",
                                                                              "parameters": "x"}]})
    assert r.status_code == 400
    assert "`tools[0].parameters`" in r.json()["error"]["message"]


async def test_the_route_asks_for_the_api_key(make_gateway: GatewayFactory) -> None:
    async with make_gateway(api_keys=(API_KEY,)) as gw:
        r = await gw.client.post(RESPONSES, json={"input": "hi"})
        assert r.status_code == 401
        r = await gw.client.post(RESPONSES, json={"input": "hi"}, headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200
        assert 'route="/v1/responses"' in (await gw.client.get("/metrics")).text
