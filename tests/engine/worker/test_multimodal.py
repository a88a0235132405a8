"""The runner's side of images: which flat rows of a step each image covers, and the encoder cache."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.multimodal import MultiModalItem
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest
from engine.worker.multimodal import EncoderCache, EncoderRunner, MultiModalSpan, plan_spans


def _item(offset: int, length: int, h: str) -> MultiModalItem:
    return MultiModalItem("image", offset, length, h, {"pixel_values": torch.full((1, 1), float(length))})


def test_spans_of_chunks_that_cut_images() -> None:
    text = Request("t", [1, 2, 3], SamplingParams())
    images = Request("i", [0] * 20, SamplingParams())
    a, b = _item(2, 6, "a"), _item(10, 6, "b")
    images.mm_items = (a, b)
    # a decode row of 1 token, then the image request's chunk [5, 12): the end of a, the start of b
    scheduled = [ScheduledRequest(text, 1, 2, True), ScheduledRequest(images, 7, 5, False)]
    assert plan_spans(scheduled, [1, 7]) == [MultiModalSpan(1, a, 3, 6), MultiModalSpan(6, b, 0, 2)]


@dataclass
class _Tower:
    """Counts its runs; an image's embeddings are rows of its length's value."""

    calls: list[float] = field(default_factory=list)

    def embed_image(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        n = float(tensors["pixel_values"].item())
        self.calls.append(n)
        return torch.arange(int(n) * 2, dtype=torch.float32).reshape(int(n), 2)


def test_each_image_is_encoded_once_and_sliced() -> None:
    tower = _Tower()
    runner = EncoderRunner(tower, max_rows=100)
    a = _item(0, 4, "a")
    rows, embeds = runner.embeddings([MultiModalSpan(3, a, 0, 2)], torch.device("cpu"))
    assert rows.tolist() == [3, 4] and embeds.tolist() == [[0, 1], [2, 3]]
    rows, embeds = runner.embeddings([MultiModalSpan(0, a, 2, 4)], torch.device("cpu"))
    assert rows.tolist() == [0, 1] and embeds.tolist() == [[4, 5], [6, 7]]
    assert tower.calls == [4.0]
    assert (runner.cache.queries, runner.cache.hits) == (2, 1)


def test_the_cache_evicts_the_least_recently_used_past_its_rows() -> None:
    cache = EncoderCache(max_rows=5)
    cache.put("a", torch.zeros(2, 1))
    cache.put("b", torch.zeros(2, 1))
    assert cache.get("a") is not None   # a is now the most recent
    cache.put("c", torch.zeros(2, 1))   # 6 rows > 5: b goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    cache.put("big", torch.zeros(9, 1))   # larger than the bound: kept alone
    assert len(cache) == 1 and cache.get("big") is not None
