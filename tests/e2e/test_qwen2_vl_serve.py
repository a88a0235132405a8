"""`sluice serve` of a tiny Qwen2-VL checkpoint (saved by transformers with its image processor and tokenizer):
chat with two ``image_url`` data-URL parts of different sizes through the official ``openai`` SDK gives the offline
``LLM.chat``'s greedy text, whose tokens are transformers' ``generate``'s (M-RoPE positions through the tokenizer
service's items), and the same text with another image does not hit the prefix cache past the text before it."""
from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from engine.entrypoints.llm import LLM, SamplingParams
from tests.engine.models.qwen2_vl_factory import IMAGE_TOKEN_ID, save_tiny_qwen2_vl
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2-vl"
MAX_TOKENS = 8


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(*images: Image.Image, text: str = "w4 w5 w6") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": _url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("qwen2_vl")
    return path, save_tiny_qwen2_vl(path)


@pytest.fixture(scope="module")
def stack(checkpoint: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("serve-qwen2-vl"), str(checkpoint[0]), "--served-model-name", MODEL,
                   "--dtype", "float32", "--max-num-seqs", "4", "--block-size", "16", "--enable-prefix-caching",
                   "--limit-mm-per-prompt", '{"image": 2}')
    try:
        yield s.start()
    finally:
        s.stop()


def _chat(stack: ServeStack, messages: list[dict[str, Any]]) -> Any:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0)


def test_served_chat_matches_offline_and_transformers(checkpoint: tuple[Path, Any], stack: ServeStack) -> None:
    path, model = checkpoint
    images = [_image(112, 84, 1), _image(56, 56, 2)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, block_size=16)
    offline = llm.chat(_messages(*images), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    ids = torch.tensor([offline.prompt_token_ids])
    pixels = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                  pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                                  mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(), do_sample=False)
    assert offline.prompt_token_ids.count(IMAGE_TOKEN_ID) == 12 + 4
    assert offline.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist()
    served = _chat(stack, _messages(*images))
    assert served.choices[0].message.content == offline.outputs[0].text
    assert served.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_prefix_cache_keys_by_image(stack: ServeStack) -> None:
    text = "w20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31 w32 w33 w34 w35 w36"
    first = _chat(stack, _messages(_image(56, 56, 5), text=text))
    again = _chat(stack, _messages(_image(56, 56, 5), text=text))
    other = _chat(stack, _messages(_image(56, 56, 6), text=text))
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 16 * 16
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0   # the image sits in the first block
    assert again.choices[0].message.content == first.choices[0].message.content
