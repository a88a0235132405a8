"""A prompt's images as the engine core holds them: each one's placeholder span in the prompt, its content hash and
the processor's tensors (the token-level proto's ``MultiModalItem``, converted at the edge).

The core reads only the spans and hashes (prefix-cache keys, admission checks); the tensors pass through it to the
runner, which runs the vision tower on them (``engine.worker.multimodal``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.errors import InvalidRequestError

if TYPE_CHECKING:
    import numpy as np
    import torch

MODALITIES = ("image",)


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image of a prompt: placeholders ``[offset, offset + length)`` of the prompt are replaced by the
    ``length`` embeddings the model makes of ``tensors`` (by transformers' names: ``pixel_values``...). ``hash``
    (hex, of the processed content) keys the runner's encoder cache and the prefix cache's blocks over the span."""

    modality: str
    offset: int
    length: int
    hash: str
    tensors: Mapping[str, torch.Tensor]

    @property
    def end(self) -> int:
        return self.offset + self.length


def check_items(items: Sequence[MultiModalItem], prompt: np.ndarray, image_token_id: int | None,
                limits: Mapping[str, int] | None, model_name: str,
                image_tokens: Callable[[Mapping[str, Any]], int] | None = None) -> None:
    """Refuses (InvalidRequestError naming ``multi_modal_data``) items a request cannot carry: any, for a text-only
    model (``image_token_id`` None); an unknown modality; more of one modality than ``limits`` allows (vLLM's
    ``--limit-mm-per-prompt``; None: no limit); a span outside the prompt, overlapping another, or over tokens that
    are not the image placeholder; an empty hash or no tensors; tensors the model's tower cannot take, or a span
    of another length than the embeddings it makes of them (``image_tokens``: the model's count, ValueError for
    tensors it cannot take)."""
    if not items:
        return
    if image_token_id is None:
        raise InvalidRequestError("multi_modal_data", f"{model_name} is a text-only model: it takes no images")
    counts: dict[str, int] = {}
    end = 0
    for i, item in enumerate(sorted(items, key=lambda it: it.offset)):
        if item.modality not in MODALITIES:
            raise InvalidRequestError("multi_modal_data", f"modality {item.modality!r} is not supported "
                                                          f"({', '.join(MODALITIES)})")
        counts[item.modality] = counts.get(item.modality, 0) + 1
        if item.length <= 0 or item.offset < end or item.end > len(prompt):
            raise InvalidRequestError("multi_modal_data", f"item {i}: placeholder span [{item.offset}, {item.end}) "
                                                          f"is empty, overlaps another or lies outside the prompt "
                                                          f"of {len(prompt)} tokens")
        if not bool((prompt[item.offset:item.end] == image_token_id).all()):
            raise InvalidRequestError("multi_modal_data", f"item {i}: the prompt's tokens [{item.offset}, "
                                                          f"{item.end}) are not all the image placeholder "
                                                          f"{image_token_id}")
        if not item.hash or not item.tensors:
            raise InvalidRequestError("multi_modal_data", f"item {i}: a content hash and the processor's tensors "
                                                          "are required")
        if image_tokens is not None:
            try:
                expected = image_tokens(item.tensors)
            except ValueError as e:
                raise InvalidRequestError("multi_modal_data", f"item {i}: {e}") from None
            if expected != item.length:
                raise InvalidRequestError("multi_modal_data", f"item {i}: {item.length} placeholders for an image "
                                                              f"the model makes {expected} embeddings of")
        end = item.end
    for modality, count in counts.items():
        limit = (limits or {}).get(modality)
        if limit is not None and count > limit:
            raise InvalidRequestError("multi_modal_data", f"{count} {modality} items in one prompt; at most {limit} "
                                                          f"are allowed (--limit-mm-per-prompt)")
