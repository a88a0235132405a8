"""`sluice serve` of a tiny LLaVA-1.5 checkpoint (saved by transformers with its processor): chat with ``image_url``
data-URL parts through the official ``openai`` SDK gives the offline ``LLM.chat``'s greedy text, whose tokens are
transformers' ``generate``'s; the prefix cache hits for the same image and not for another one under the same text;
the bad-input matrix over REST (400 naming the part) and over the public gRPC API (INVALID_ARGUMENT), and every KV
block free afterwards."""
from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from engine.entrypoints.llm import LLM, SamplingParams
from proto.sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.engine.models.llava_factory import save_tiny_llava
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

MODEL = "tiny-llava"
MAX_TOKENS = 8
TEXT = "w4 w5 w6"


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


IMAGES = [_image(32, 32, 1), _image(80, 30, 2), _image(20, 64, 3)]


def _messages(*images: Image.Image, text: str = TEXT) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": _url(im), "detail": "auto"}}
                                   for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("llava")
    return path, save_tiny_llava(path)


@pytest.fixture(scope="module")
def stack(checkpoint: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("serve-llava"), str(checkpoint[0]), "--served-model-name", MODEL,
                   "--dtype", "float32", "--max-num-seqs", "4", "--block-size", "16", "--enable-prefix-caching",
                   "--limit-mm-per-prompt", '{"image": 2}')
    try:
        yield s.start()
    finally:
        s.stop()


def _sdk(stack: ServeStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def _chat(stack: ServeStack, messages: list[dict[str, Any]]) -> Any:
    return _sdk(stack).chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=MAX_TOKENS, temperature=0)


def test_greedy_text_matches_offline_and_transformers(checkpoint: tuple[Path, Any], stack: ServeStack) -> None:
    path, model = checkpoint
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, block_size=16)
    processor = AutoProcessor.from_pretrained(path)
    for images in ([IMAGES[1]], [IMAGES[2], IMAGES[0]]):
        offline = llm.chat(_messages(*images), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
        inputs = processor.apply_chat_template(
            [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                          {"type": "text", "text": TEXT}]}],
            add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            expected = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert offline.outputs[0].token_ids == expected[0, inputs["input_ids"].shape[1]:].tolist()
        served = _chat(stack, _messages(*images))
        assert served.choices[0].message.content == offline.outputs[0].text
        assert served.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_prefix_cache_keys_by_image(stack: ServeStack) -> None:
    text = "w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31 w32 w33 w34 w35 w36"   # past the first blocks
    first = _chat(stack, _messages(IMAGES[0], text=text))
    again = _chat(stack, _messages(IMAGES[0], text=text))
    other = _chat(stack, _messages(_image(32, 32, 7), text=text))   # an image no request here sent before
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0   # the image sits in the first block


def _truncated_png() -> bytes:
    data = _png(IMAGES[1])
    return data[:len(data) // 2]


def test_bad_inputs_over_rest(stack: ServeStack) -> None:
    good = {"type": "image_url", "image_url": {"url": _url(IMAGES[0])}}
    cases = [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "messages[0].parts[0]",
         "does not decode"),
        ([good, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(_truncated_png()).decode()}}],
         "messages[0].parts[1]", "does not decode"),
        ([good, good, good, {"type": "text", "text": "w3"}], "messages[0].parts[2]", "--limit-mm-per-prompt"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "messages[0].parts[0]",
         "'example.com' is not in --allowed-media-domains"),
        ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "messages[0].content[0]",
         "'input_audio' is not supported"),
    ]
    for content, param, words in cases:
        r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        assert words in error["message"], error


def _generate(stub: generation_pb2_grpc.GenerationStub, *messages: generation_pb2.ChatMessage) -> list[Any]:
    request = generation_pb2.GenerateRequest(
        model=MODEL, chat=generation_pb2.Chat(messages=messages),
        sampling=common_pb2.SamplingParameters(temperature=0.0),
        stopping=generation_pb2.StoppingCriteria(max_tokens=MAX_TOKENS))
    return list(stub.Generate(request, timeout=60))


def test_public_grpc_api(stack: ServeStack) -> None:
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{stack.tokenizer_port}"))
    image = generation_pb2.ContentPart(image=generation_pb2.Image(data=_png(IMAGES[1])))
    text = generation_pb2.ContentPart(text=TEXT)
    out = _generate(stub, generation_pb2.ChatMessage(role="user", parts=[image, text]))
    served = _chat(stack, _messages(IMAGES[1]))
    assert "".join(m.text for m in out) == served.choices[0].message.content
    bad = [
        (generation_pb2.ChatMessage(role="user", parts=[generation_pb2.ContentPart(
            image=generation_pb2.Image(data=_truncated_png())), text]), "messages[0].parts[0]"),
        (generation_pb2.ChatMessage(role="user", parts=[generation_pb2.ContentPart(
            image=generation_pb2.Image(data=b"not an image")), text]), "messages[0].parts[0]"),
        (generation_pb2.ChatMessage(role="user", content="w3", parts=[image, text]), "messages[0].content"),
        (generation_pb2.ChatMessage(role="user", parts=[generation_pb2.ContentPart(
            image=generation_pb2.Image(url="http://10.0.0.1/a.png")), text]), "messages[0].parts[0]"),
        (generation_pb2.ChatMessage(role="user", parts=[image, image, image, text]), "messages[0].parts[2]"),
    ]
    for message, field in bad:
        with pytest.raises(grpc.RpcError) as info:
            _generate(stub, message)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{field}: "), info.value.details()
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", parts=[image, text])])
    tokens = stub.Tokenize(generation_pb2.TokenizeRequest(model=MODEL, chat=chat), timeout=30)
    assert tokens.count == served.usage.prompt_tokens   # the image's placeholders counted
    rest = httpx.post(f"{stack.base_url}/tokenize", timeout=30, json={"model": MODEL, "messages": _messages(IMAGES[1])})
    assert rest.json()["count"] == served.usage.prompt_tokens, rest.text
    with pytest.raises(grpc.RpcError) as info:   # ApplyChatTemplate renders content only: parts refused by name
        stub.ApplyChatTemplate(generation_pb2.ApplyChatTemplateRequest(model=MODEL, chat=chat), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("messages[0].parts: ")
    info_after = stack.engine_idle()
    assert info_after.free_kv_blocks == info_after.total_kv_blocks
    assert info_after.num_running == info_after.num_waiting == 0
