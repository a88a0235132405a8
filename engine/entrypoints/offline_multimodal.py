"""The offline API's images: vLLM's prompt dicts with ``multi_modal_data`` and chat messages with ``image_url``
parts, processed in process by the model's own processor (``engine.text.multimodal``) into the engine core's
``MultiModalItem``s."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from common.errors import InvalidRequestError
from engine.core.multimodal import MODALITIES, MultiModalItem
from engine.text.multimodal import FIELD, MultiModalProcessor, ProcessedPrompt, is_multimodal


def load_processor(model_path: str, image_token_id: int | None,
                   limits: Mapping[str, int] | None) -> MultiModalProcessor | None:
    """The model's processor when it is a vision-language model the engine runs (None: a text-only model)."""
    if image_token_id is None or not is_multimodal(model_path):
        return None
    return MultiModalProcessor(model_path, image_token_id, limits)


def engine_items(processed: ProcessedPrompt) -> tuple[MultiModalItem, ...]:
    """The processor's items as the engine core takes them (their arrays as tensors, not copied)."""
    return tuple(MultiModalItem(it.modality, it.offset, it.length, it.hash,
                                {k: torch.from_numpy(v) for k, v in it.tensors.items()}) for it in processed.items)


def prompt_images(prompt: object) -> list[Any] | None:
    """The images of a vLLM prompt dict's ``multi_modal_data`` (``{"image": image or [images]}``); None when it has
    none. InvalidRequestError naming the field for another modality or shape."""
    if not isinstance(prompt, Mapping) or prompt.get(FIELD) is None:
        return None
    data = prompt[FIELD]
    if not isinstance(data, Mapping):
        raise InvalidRequestError(FIELD, 'must be a dict like {"image": image or [images]}')
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise InvalidRequestError(FIELD, f"modality {unknown[0]!r} is not supported ({', '.join(MODALITIES)})")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def has_image_parts(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, Mapping) and p.get("type") == "image_url"
                                                          for p in m["content"]) for m in messages)


def text_only_refusal(model_name: str) -> InvalidRequestError:
    return InvalidRequestError(FIELD, f"{model_name} is a text-only model: it takes no images")
