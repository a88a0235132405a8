"""Images inside the step: which placeholder rows of a step's flat inputs each image covers, the vision tower run
on each image once (its embeddings kept in an encoder cache keyed by the image's content hash), and the rows handed
to the model to replace those placeholders' token embeddings.

A prefill chunk may cover only part of an image's placeholders (chunked prefill, or a prefix-cache hit that ends
inside them): the image's embeddings are computed whole, once, and each chunk takes its slice, from the cache.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.core.multimodal import MultiModalItem
    from engine.core.scheduler_output import ScheduledRequest

# Embedding rows the encoder cache keeps by default: 16 LLaVA-1.5 images of 576 placeholders.
DEFAULT_CACHE_ROWS = 16 * 576


@dataclass(frozen=True)
class MultiModalSpan:
    """Rows ``[lo, hi)`` of ``item``'s embeddings go to the step's flat rows from ``flat_start`` on."""

    flat_start: int
    item: MultiModalItem
    lo: int
    hi: int


def plan_spans(scheduled: Sequence[ScheduledRequest], row_tokens: Sequence[int]) -> list[MultiModalSpan]:
    """The spans of a step whose rows (``scheduled``, laid out flat one after another, ``row_tokens`` each) cover
    image placeholders: each row's new tokens ``[start, start + num_new_tokens)`` against its request's items."""
    spans: list[MultiModalSpan] = []
    offset = 0
    for s, n in zip(scheduled, row_tokens):
        items = s.request.mm_items
        if items:
            start, end = s.start, s.start + s.num_new_tokens
            for item in items:
                lo, hi = max(item.offset, start), min(item.end, end)
                if lo < hi:
                    spans.append(MultiModalSpan(offset + lo - start, item, lo - item.offset, hi - item.offset))
        offset += n
    return spans


class VisionModel(Protocol):
    def embed_image(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor: ...


class EncoderCache:
    """The vision tower's outputs by item hash, least recently used evicted past ``max_rows`` embedding rows (an
    item larger than that is still kept alone, for the chunks that follow). ``queries`` counts lookups of an item
    by a step, ``hits`` those found: a chunk that continues an image, or another request with the same image."""

    def __init__(self, max_rows: int = DEFAULT_CACHE_ROWS) -> None:
        self.max_rows = max_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.queries = 0
        self.hits = 0

    def get(self, key: str) -> torch.Tensor | None:
        self.queries += 1
        found = self._entries.get(key)
        if found is not None:
            self.hits += 1
            self._entries.move_to_end(key)
        return found

    def put(self, key: str, embeds: torch.Tensor) -> None:
        self._entries[key] = embeds
        self._rows += len(embeds)
        while self._rows > self.max_rows and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._rows -= len(old)

    def __len__(self) -> int:
        return len(self._entries)


class EncoderRunner:
    """Runs a vision-language model's encoder for a step's spans (``embeddings``), through the cache."""

    def __init__(self, model: VisionModel, max_rows: int = DEFAULT_CACHE_ROWS) -> None:
        self.model = model
        self.cache = EncoderCache(max_rows)

    def item_embeddings(self, item: MultiModalItem) -> torch.Tensor:
        """All of ``item``'s placeholder embeddings [length, hidden]; ValueError when the model makes a different
        number of them than the item has placeholders."""
        embeds = self.cache.get(item.hash)
        if embeds is None:
            embeds = self.model.embed_image(dict(item.tensors))
            if len(embeds) != item.length:
                raise ValueError(f"image {item.hash[:16]}: the model makes {len(embeds)} embeddings of it, the "
                                 f"prompt has {item.length} placeholders for it")
            self.cache.put(item.hash, embeds)
        return embeds

    def embeddings(self, spans: Sequence[MultiModalSpan], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat rows [R] int64, their embeddings [R, hidden]) of the step's ``spans``, on ``device``."""
        rows = torch.cat([torch.arange(s.flat_start, s.flat_start + s.hi - s.lo) for s in spans]).to(device)
        embeds = torch.cat([self.item_embeddings(s.item)[s.lo:s.hi] for s in spans])
        return rows, embeds
