"""``input_image`` content in ``POST /v1/responses``, sent by the official ``openai`` SDK in its own shape, reaches the
fake backend as chat's image parts do (``ChatMessage.parts``: text and image URL in order); later turns carry the
image through ``previous_response_id``; ``input_items`` lists the part as given; the refusals name the part."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.conftest import SERVED, Gateway
from tests.gateway.responses_api.test_route import RESPONSES, sdk

pytestmark = pytest.mark.anyio

URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ"
       "/pLvAAAAAElFTkSuQmCC")


def parts(gateway: Gateway, call: int = -1, message: int = 0) -> list[tuple[str, str]]:
    """The backend's parts of one message: ("text", text) or ("image", url)."""
    sent = gateway.backend_calls.generate_requests[call].chat.messages[message]
    return [("text", p.text) if p.WhichOneof("kind") == "text" else ("image", p.image.url) for p in sent.parts]


def image_input(*content: dict[str, Any]) -> list[Any]:
    return [{"role": "user", "content": list(content)}]


async def test_an_input_image_reaches_the_backend_as_chat_s_image_part(gateway: Gateway) -> None:
    client = sdk(gateway)
    first = await client.responses.create(model=SERVED, input=image_input(
        {"type": "input_text", "text": "What is"}, {"type": "input_image", "image_url": URL, "detail": "auto"},
        {"type": "input_text", "text": "this?"}))
    assert first.output_text == "Hello world"
    assert parts(gateway) == [("text", "What is"), ("image", URL), ("text", "this?")]
    assert gateway.backend_calls.generate_requests[-1].chat.messages[0].content == ""
    listed = await client.responses.input_items.list(first.id)
    assert [c.type for c in listed.data[0].content] == ["input_text", "input_image", "input_text"]  # type: ignore
    await client.responses.create(model=SERVED, input="And now?", previous_response_id=first.id)
    assert parts(gateway) == [("text", "What is"), ("image", URL), ("text", "this?")]
    assert [(m.role, m.content) for m in gateway.backend_calls.generate_requests[-1].chat.messages[1:]] == [
        ("assistant", "Hello world"), ("user", "And now?")]


async def test_text_only_parts_stay_one_string(gateway: Gateway) -> None:
    await sdk(gateway).responses.create(model=SERVED, input=image_input({"type": "input_text", "text": "a"},
                                                                        {"type": "input_text", "text": "b"}))
    sent = gateway.backend_calls.generate_requests[-1].chat.messages[0]
    assert (sent.content, list(sent.parts)) == ("ab", [])


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "input_image", "file_id": "file-1"}, "input[0].content[1].file_id"),
    ({"type": "input_image", "image_url": {"url": URL}}, "input[0].content[1].image_url"),
    ({"type": "input_image"}, "input[0].content[1].image_url"),
    ({"type": "input_image", "image_url": URL, "detail": "ultra"}, "messages[0].content[1].image_url.detail"),
    ({"type": "input_file", "file_data": "x"}, "input[0].content[1]"),
])
async def test_a_bad_image_part_is_refused_naming_it(gateway: Gateway, part: dict[str, Any], param: str) -> None:
    calls = len(gateway.backend_calls.generate_requests)
    r = await gateway.client.post(RESPONSES, json={"model": SERVED, "input": image_input(
        {"type": "input_image", "image_url": URL}, part)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert len(gateway.backend_calls.generate_requests) == calls
