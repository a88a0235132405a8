"""``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and ``POST .../cancel``
through the official ``openai`` SDK, on the fake backend: a stored response comes back as it was returned, a
deleted or unstored one is a 404 in OpenAI's error body."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.responses import ResponseFunctionToolCallItem, ResponseInputMessageItem

from tests.gateway.conftest import SERVED, Gateway
from tests.gateway.responses_api.test_route import sdk

pytestmark = pytest.mark.anyio


async def test_a_stored_response_is_retrieved_then_deleted(gateway: Gateway) -> None:
    client = sdk(gateway)
    created = await client.responses.create(model=SERVED, input="hi", instructions="Be brief.")
    got = await client.responses.retrieve(created.id)
    assert got == created and got.output_text == "Hello world"
    r = await gateway.client.delete(f"/v1/responses/{created.id}")
    assert (r.status_code, r.json()) == (200, {"id": created.id, "object": "response", "deleted": True})
    for call in (client.responses.retrieve(created.id), client.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError) as info:
            await call
        assert info.value.body == {"message": f"Response with id '{created.id}' not found.",
                                   "type": "invalid_request_error", "param": "response_id", "code": None}
    with pytest.raises(openai.NotFoundError):  # nor can a conversation continue from it
        await client.responses.create(model=SERVED, input="again", previous_response_id=created.id)


async def test_the_sdk_deletes(gateway: Gateway) -> None:
    client = sdk(gateway)
    created = await client.responses.create(model=SERVED, input="hi")
    assert await client.responses.delete(created.id) is None  # the SDK returns nothing on success
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)


async def test_a_streamed_response_is_retrieved_as_its_last_event_says(gateway: Gateway) -> None:
    client = sdk(gateway)
    events = [e async for e in await client.responses.create(model=SERVED, input="hi", stream=True)]
    assert events[-1].type == "response.completed"
    assert await client.responses.retrieve(events[-1].response.id) == events[-1].response


async def test_an_unstored_response_is_not_found(gateway: Gateway) -> None:
    client = sdk(gateway)
    created = await client.responses.create(model=SERVED, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_never")


async def test_input_items_are_listed_newest_first_and_paged(gateway: Gateway) -> None:
    client = sdk(gateway)
    given: Any = [{"role": "user", "content": "hi"},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and?"}]}]
    created = await client.responses.create(model=SERVED, input=given)
    page = await client.responses.input_items.list(created.id)
    assert [i.type for i in page.data] == ["message", "function_call_output", "function_call", "message"]
    first = page.data[-1]
    assert isinstance(first, ResponseInputMessageItem) and first.content[0].type == "input_text"
    assert first.content[0].text == "hi" and first.role == "user"
    assert isinstance(page.data[2], ResponseFunctionToolCallItem) and page.data[2].call_id == "c1"
    assert len({i.id for i in page.data}) == 4
    ascending = [i async for i in client.responses.input_items.list(created.id, order="asc", limit=1)]
    assert [i.id for i in ascending] == [i.id for i in reversed(page.data)]  # the SDK followed `after`, page by page
    r = await gateway.client.get(f"/v1/responses/{created.id}/input_items", params={"limit": 0})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "limit")


async def test_cancel_and_replay_are_refused(gateway: Gateway) -> None:
    client = sdk(gateway)
    created = await client.responses.create(model=SERVED, input="hi")
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.cancel(created.id)
    assert "background" in info.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("resp_never")
    r = await gateway.client.get(f"/v1/responses/{created.id}", params={"stream": "true"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "stream")
