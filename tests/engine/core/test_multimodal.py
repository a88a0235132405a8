"""Images in the core: the prefix cache's extra keys of blocks over placeholders, and the admission checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import InvalidRequestError
from engine.core.block_hashing import block_extra_keys, mm_block_hashes
from engine.core.block_manager import BlockManager
from engine.core.block_manager import block_extra_keys as request_extra_keys
from engine.core.lora_request import LoRARequest
from engine.core.multimodal import MultiModalItem, check_items
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

IMAGE = 9


def _item(offset: int, length: int, h: str) -> MultiModalItem:
    return MultiModalItem("image", offset, length, h, {"pixel_values": torch.zeros(1, 3, 2, 2)})


def test_blocks_take_the_hashes_of_the_images_they_cover() -> None:
    spans = [(2, 4, "a"), (6, 10, "b")]   # tokens [2, 6) and [6, 16)
    assert mm_block_hashes(spans, 0, 4) == ("a",)
    assert mm_block_hashes(spans, 4, 8) == ("a", "b")
    assert mm_block_hashes(spans, 12, 16) == ("b",)
    assert mm_block_hashes(spans, 16, 20) == ()
    # vLLM's order: the adapter, the images, the salt (first block only)
    assert block_extra_keys("lora", "salt", True, ("a", "b")) == ("lora", "a", "b", "salt")
    assert block_extra_keys(None, "salt", False, ("b",)) == ("b",)
    assert block_extra_keys(None, None, False, ()) is None


def test_a_request_keys_only_its_blocks_over_images() -> None:
    prompt = [1, 2] + [IMAGE] * 5 + [3] * 9
    request = Request("r", prompt, SamplingParams(max_tokens=1), lora_request=LoRARequest("ad", 1, "/p"))
    request.mm_items = (_item(2, 5, "h"),)
    assert [request_extra_keys(request, i, 4) for i in range(4)] == [("ad", "h"), ("ad", "h"), ("ad",), ("ad",)]


def test_the_same_text_with_another_image_hashes_apart() -> None:
    prompt = [1] + [IMAGE] * 8 + [4] * 7
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    hashes = []
    for h in ("x", "y", "x"):
        request = Request(h, prompt, SamplingParams(max_tokens=1))
        request.mm_items = (_item(1, 8, h),)
        hashes.append(manager._block_hashes(request, 4))
    assert hashes[0] == hashes[2]
    # blocks 0-2 cover the image; block 3 is chained behind them
    assert all(a != b for a, b in zip(hashes[0], hashes[1]))


def test_check_items_limits_and_text_only_models() -> None:
    prompt = np.array([1] + [IMAGE] * 4 + [2] + [IMAGE] * 4)
    items = [_item(1, 4, "a"), _item(6, 4, "b")]
    check_items(items, prompt, IMAGE, {"image": 2}, "m")
    with pytest.raises(InvalidRequestError, match="2 image items in one prompt; at most 1"):
        check_items(items, prompt, IMAGE, {"image": 1}, "m")
    with pytest.raises(InvalidRequestError, match="m is a text-only model"):
        check_items(items, prompt, None, None, "m")
    check_items([], prompt, None, None, "m")   # no images: nothing to check
