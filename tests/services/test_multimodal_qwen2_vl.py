"""The tokenizer service's chats with image parts for Qwen2-VL (services/tokenizer/multimodal.py over
``engine.text.qwen2_vl_inputs``): the prompt ids and each image's tensors against transformers' image processor,
and the items read back by the engine core answering as transformers' ``generate``."""
from __future__ import annotations

import asyncio
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

from engine.entrypoints.grpc_multimodal import items_from_pb
from engine.entrypoints.llm import LLM, SamplingParams
from proto.sluice.v1 import generation_pb2
from services.tokenizer.multimodal import ChatImages, MediaSettings
from tests.engine.models.qwen2_vl_factory import IMAGE_TOKEN_ID, MERGE_SIZE, save_tiny_qwen2_vl


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


PNGS = [_png(112, 84, 1), _png(56, 56, 2)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2VLForConditionalGeneration]:
    path = tmp_path_factory.mktemp("qwen2_vl")
    return path, save_tiny_qwen2_vl(path)


async def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def test_chat_parts_match_transformers(checkpoint: tuple[Path, Qwen2VLForConditionalGeneration]) -> None:
    path, model = checkpoint
    images = ChatImages.load(str(path), MediaSettings(), "tiny-qwen2-vl")
    parts = [generation_pb2.ContentPart(text="w4"),
             generation_pb2.ContentPart(image=generation_pb2.Image(data=PNGS[0])),
             generation_pb2.ContentPart(text="w5 w6"),
             generation_pb2.ContentPart(image=generation_pb2.Image(data=PNGS[1]))]
    request = generation_pb2.GenerateRequest(chat=generation_pb2.Chat(messages=[
        generation_pb2.ChatMessage(role="user", parts=parts)]))
    ids, items = asyncio.run(images.prompt(request, 1024, 100_000, _run))

    pil = [Image.open(io.BytesIO(p)).convert("RGB") for p in PNGS]
    pixels = AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt")
    counts = [int(g.prod()) // MERGE_SIZE ** 2 for g in pixels["image_grid_thw"]]
    pad = "<|image_pad|>"
    text = (f"<|im_start|>user\nw4<|vision_start|>{pad * counts[0]}<|vision_end|>w5 w6<|vision_start|>"
            f"{pad * counts[1]}<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    expected_ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    assert ids == expected_ids
    engine_items = items_from_pb(items)
    assert [(it.offset, it.length) for it in engine_items] == [
        (ids.index(IMAGE_TOKEN_ID), counts[0]), (len(ids) - ids[::-1].index(IMAGE_TOKEN_ID) - counts[1], counts[1])]
    patches = np.cumsum([0, *(int(g.prod()) for g in pixels["image_grid_thw"])])
    for i, item in enumerate(engine_items):
        np.testing.assert_array_equal(item.tensors["pixel_values"].numpy(),
                                      pixels["pixel_values"][patches[i]:patches[i + 1]].numpy())
        np.testing.assert_array_equal(item.tensors["image_grid_thw"].numpy(), pixels["image_grid_thw"][i:i + 1])

    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, block_size=16)
    llm.engine.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=6), mm_items=engine_items)
    tokens: list[int] = []
    while llm.engine.has_unfinished_requests():
        tokens += [t for out in llm.engine.step() for t in out.new_token_ids]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        expected = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                                  mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(), max_new_tokens=6,
                                  do_sample=False)
    assert tokens == expected[0, len(ids):].tolist()
