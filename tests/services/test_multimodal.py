"""The tokenizer service's chats with image parts (services/tokenizer/multimodal.py): prompt ids against
transformers' own processor on a tiny LLaVA checkpoint, the engine items' tensors bytes for bytes, the refusals each
naming the part, fetching from allowed domains only within the size and time limits; the gateway's content arrays
as the public API's parts."""
from __future__ import annotations

import asyncio
import http.server
import io
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError
from transformers import AutoProcessor

from common.errors import InvalidRequestError
from engine.entrypoints.grpc_multimodal import items_from_pb
from gateway.backend import ChatTurn, ContentPart, Prompt
from gateway.convert import chat_to_pb
from gateway.models import ChatMessage
from gateway.multimodal import content_parts
from proto.sluice.v1 import generation_pb2
from services.tokenizer.multimodal import ChatImages, MediaSettings
from tests.engine.models.llava_factory import IMAGE_TOKEN_ID, IMAGE_TOKENS, save_tiny_llava

TEXT = "w4 w5 w6"


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


PNGS = [_png(32, 32, 1), _png(80, 30, 2)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llava")
    save_tiny_llava(path)
    return path


def _images(path: Path, **settings: Any) -> ChatImages:
    return ChatImages.load(str(path), MediaSettings(**settings), "tiny-llava")


async def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _request(*messages: generation_pb2.ChatMessage, **fields: Any) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(chat=generation_pb2.Chat(messages=messages), **fields)


def _image(data: bytes | None = None, url: str | None = None) -> generation_pb2.ContentPart:
    image = generation_pb2.Image(data=data) if data is not None else generation_pb2.Image(url=url)
    return generation_pb2.ContentPart(image=image)


def _user(*parts: generation_pb2.ContentPart, content: str = "") -> generation_pb2.ChatMessage:
    return generation_pb2.ChatMessage(role="user", content=content, parts=parts)


def _prompt(images: ChatImages, request: generation_pb2.GenerateRequest) -> tuple[list[int], list[Any]]:
    return asyncio.run(images.prompt(request, 1024, 100_000, _run))


def test_prompt_and_items_match_transformers(checkpoint: Path) -> None:
    images = _images(checkpoint)
    ids, items = _prompt(images, _request(_user(_image(PNGS[0]), _image(PNGS[1]),
                                                generation_pb2.ContentPart(text=TEXT))))
    processor = AutoProcessor.from_pretrained(checkpoint)
    pil = [Image.open(io.BytesIO(p)) for p in PNGS]
    expected = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": pil[0]}, {"type": "image", "image": pil[1]},
                                      {"type": "text", "text": TEXT}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np")
    assert ids == expected["input_ids"][0].tolist()
    spans = [(int(i), IMAGE_TOKENS) for i in np.flatnonzero(np.asarray(ids) == IMAGE_TOKEN_ID)[::IMAGE_TOKENS]]
    assert [(it.offset, it.length) for it in items] == spans
    engine_items = items_from_pb(items)   # what the engine reads back
    for i, item in enumerate(engine_items):
        np.testing.assert_array_equal(item.tensors["pixel_values"].numpy(), expected["pixel_values"][i:i + 1])
    assert items[0].hash != items[1].hash and len(items[0].hash) == 64


def test_refusals_name_the_part(checkpoint: Path) -> None:
    images = _images(checkpoint, limit_mm_per_prompt={"image": 1})
    text = generation_pb2.ContentPart(text=TEXT)
    cases = [
        (_request(_user(_image(PNGS[0]), text, content="w3")), "messages[0].content"),
        (_request(_user(text), _user(_image(PNGS[0]), _image(PNGS[1]))), "messages[1].parts[1]"),
        (_request(_user(_image(PNGS[0][:200]))), "messages[0].parts[0]"),
        (_request(_user(_image(b"GIF89a-but-not"))), "messages[0].parts[0]"),
        (_request(_user(_image(url="data:image/png;base64,!!"))), "messages[0].parts[0]"),
        (_request(_user(_image(url="https://example.com/a.png"))), "messages[0].parts[0]"),
        (_request(_user(_image(url="ftp://example.com/a.png"))), "messages[0].parts[0]"),
        (_request(_user(generation_pb2.ContentPart())), "messages[0].parts[0]"),
        (_request(_user(_image(PNGS[0])), truncate_prompt_tokens=8), "truncate_prompt_tokens"),
    ]
    for request, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            _prompt(images, request)
        assert info.value.field == field, info.value
    with pytest.raises(InvalidRequestError, match="'example.com' is not in --allowed-media-domains"):
        _prompt(images, _request(_user(_image(url="https://example.com/a.png"))))
    small = _images(checkpoint, max_image_bytes=len(PNGS[0]), max_image_pixels=32 * 32)
    for part, words in ((_image(PNGS[1]), "bytes; at most"), (_image(_png(40, 40, 3)[:len(PNGS[0])]), "pixels")):
        with pytest.raises(InvalidRequestError, match=words) as info:
            _prompt(small, _request(_user(part)))
        assert info.value.field == "messages[0].parts[0]"


def test_a_text_only_model_refuses_parts() -> None:
    images = ChatImages(None, MediaSettings(), "tiny-llama")
    for part in (_image(PNGS[0]), generation_pb2.ContentPart(text=TEXT)):
        with pytest.raises(InvalidRequestError, match="text-only model") as info:
            _prompt(images, _request(_user(part)))
        assert info.value.field == "messages[0].parts[0]"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:   # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(2)
        body = PNGS[0] if self.path != "/big.png" else PNGS[0] * 200
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except ConnectionError:   # the service gave up on it: what the test wants
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_fetch_from_allowed_domains_within_limits(checkpoint: Path, server: str) -> None:
    images = _images(checkpoint, allowed_media_domains=("127.0.0.1",), max_image_bytes=len(PNGS[0]) * 10,
                     fetch_timeout_s=0.5)
    by_url, items = _prompt(images, _request(_user(_image(url=f"{server}/a.png"))))
    by_data, data_items = _prompt(images, _request(_user(_image(PNGS[0]))))
    assert by_url == by_data and items[0].hash == data_items[0].hash
    for path, words in (("big.png", "over"), ("slow.png", "took over 0.5 s")):
        with pytest.raises(InvalidRequestError, match=words) as info:
            _prompt(images, _request(_user(_image(url=f"{server}/{path}"))))
        assert info.value.field == "messages[0].parts[0]"


def test_gateway_content_arrays() -> None:
    text_only = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]})
    assert content_parts(text_only.content) == ("a\nb", ())   # type: ignore[arg-type]
    mixed = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x", "detail": "auto"}}]})
    text, parts = content_parts(mixed.content)   # type: ignore[arg-type]
    assert (text, parts) == ("", (ContentPart(text="a"), ContentPart(image_url="data:x")))
    chat = chat_to_pb(Prompt(chat=(ChatTurn("user", text, parts=parts),)))
    assert chat.messages[0].content == ""
    assert [p.WhichOneof("kind") for p in chat.messages[0].parts] == ["text", "image"]
    assert chat.messages[0].parts[1].image.url == "data:x"
    for detail in ("low", "high"):   # a resolution the model's processor would not use: refused, not ignored
        with pytest.raises(ValidationError) as refused:
            ChatMessage.model_validate({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:x", "detail": detail}}]})
        (error,) = refused.value.errors()
        assert error["loc"][-1] == "detail" and "cannot be honoured" in error["msg"]
