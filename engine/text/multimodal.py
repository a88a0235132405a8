"""A prompt's images made into model inputs by the model's own transformers processor (``AutoProcessor`` from the
checkpoint directory): pixel tensors, the prompt's ids with each image's placeholder expanded to as many tokens as
the model makes embeddings of it, each image's placeholder span and the hash of its processed content.

The offline ``LLM`` uses it in process; the tokenizer service is meant to use the same code and send the result
as the token-level proto's ``MultiModalItem`` (a leaf of ``engine.text``: numpy arrays, no torch, no engine types).
OpenAI chat messages' ``image_url`` parts (``data:`` URLs) are decoded here too.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import InvalidRequestError

# config.json model_type values whose processor this module drives (one placeholder run per image).
MULTIMODAL_MODEL_TYPES = ("llava", "llava_next", "qwen2_vl")
# Processor outputs that are the prompt's, not an image's.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids")
FIELD = "multi_modal_data"


@dataclass(frozen=True)
class ProcessedItem:
    """One image as the engine takes it (the proto's ``MultiModalItem``)."""

    modality: str
    offset: int
    length: int
    hash: str
    tensors: dict[str, np.ndarray]


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str
    prompt_token_ids: list[int]
    items: list[ProcessedItem]


def model_type(model_path: str) -> str | None:
    """config.json's ``model_type`` of a Hugging Face directory (None: no config.json, e.g. a GGUF file)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("model_type")
    return value if isinstance(value, str) else None


def is_multimodal(model_path: str) -> bool:
    return model_type(model_path) in MULTIMODAL_MODEL_TYPES


def content_hash(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 (hex) of an item's processed tensors: each one's name, dtype, shape and bytes, by name."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.tobytes())
    return h.hexdigest()


def load_image_url(url: str, where: str) -> Any:
    """A PIL image from a ``data:image/...;base64,`` URL; InvalidRequestError naming ``where`` for any other URL
    or an image that does not decode."""
    from PIL import Image, UnidentifiedImageError

    if not url.startswith("data:"):
        raise InvalidRequestError(where, "only data: URLs are supported here (data:image/png;base64,...); "
                                         "fetching http(s) URLs is not")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError(where, "a data: URL must be base64 encoded (data:image/png;base64,...)")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except (binascii.Error, UnidentifiedImageError, OSError, ValueError) as e:
        raise InvalidRequestError(where, f"the image does not decode: {e}") from None
    return image


def chat_parts(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """OpenAI chat messages -> (the messages with each ``image_url`` part as ``{"type": "image"}``, as transformers'
    chat templates take them, and the decoded images in order)."""
    images: list[Any] = []
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, Mapping) else ref
                if not isinstance(url, str):
                    raise InvalidRequestError(where, "an image_url part needs image_url.url")
                images.append(load_image_url(url, where))
                parts.append({"type": "image"})
            else:
                raise InvalidRequestError(where, f"content part type {kind!r} is not supported (text, image_url)")
        out.append({**message, "content": parts})
    return out, images


def _height_width(image: Any) -> tuple[int, int]:
    """An image's (height, width): a PIL image's, or an array's in (H, W, C) or (C, H, W) layout."""
    if hasattr(image, "height") and hasattr(image, "width"):
        return int(image.height), int(image.width)
    shape = np.asarray(image).shape
    return (int(shape[1]), int(shape[2])) if len(shape) == 3 and shape[0] in (1, 3, 4) else (int(shape[0]),
                                                                                           int(shape[1]))


class MultiModalProcessor:
    """The model's processor, loaded once from its directory. ``limits``: vLLM's ``--limit-mm-per-prompt``."""

    def __init__(self, model_path: str, image_token_id: int, limits: Mapping[str, int] | None = None) -> None:
        from transformers import AutoProcessor

        from engine.text.qwen2_vl_inputs import Qwen2VLInputs

        # Qwen2-VL's processor needs torchvision (for videos): its image processor and tokenizer are used apart
        self.processor = (Qwen2VLInputs(model_path) if model_type(model_path) == "qwen2_vl"
                          else AutoProcessor.from_pretrained(model_path))
        self.image_token_id = image_token_id
        self.limits = dict(limits or {})

    def check_count(self, modality: str, count: int) -> None:
        limit = self.limits.get(modality)
        if limit is not None and count > limit:
            raise InvalidRequestError(FIELD, f"{count} {modality} items in one prompt; at most {limit} are allowed "
                                             "(--limit-mm-per-prompt)")

    def process_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                     chat_template: str | None = None) -> ProcessedPrompt:
        """OpenAI chat messages with ``image_url`` parts through the processor's chat template (or
        ``chat_template``) and the processor, as transformers' ``processor.apply_chat_template(tokenize=True)``:
        special tokens added unless the rendered prompt starts with the BOS token."""
        conversation, images = chat_parts(messages)
        template = chat_template or getattr(self.processor, "chat_template", None)
        if not template:
            raise InvalidRequestError("chat_template", "the model's processor has no chat template: pass one")
        text = str(self.processor.apply_chat_template(conversation, chat_template=template,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False))
        bos = self.processor.tokenizer.bos_token
        return self.process(text, images, add_special_tokens=not (bos and text.startswith(bos)))

    def process(self, prompt: str, images: Sequence[Any], *, add_special_tokens: bool = True) -> ProcessedPrompt:
        """Runs the processor over the prompt (one ``<image>`` placeholder per image, as the model's processor
        takes it) and its images. InvalidRequestError naming ``multi_modal_data``: over the limit, or placeholders
        that do not match the images."""
        self.check_count("image", len(images))
        try:
            out = self.processor(text=prompt, images=list(images) or None, return_tensors="np",
                                 add_special_tokens=add_special_tokens)
        except (ValueError, TypeError, OSError) as e:
            raise InvalidRequestError(FIELD, f"the model's processor refused the prompt and its images: {e}") from None
        ids = np.asarray(out["input_ids"]).reshape(-1)
        positions = np.flatnonzero(ids == self.image_token_id)
        n = len(images)
        if n == 0:
            if len(positions):
                raise InvalidRequestError(FIELD, "the prompt has image placeholders but no image was given")
            return ProcessedPrompt(prompt, ids.tolist(), [])
        counts = self._counts(images, len(positions))
        if sum(counts) != len(positions):
            raise InvalidRequestError(FIELD, f"{len(positions)} image placeholder tokens for {n} images of "
                                             f"{', '.join(map(str, counts))} tokens")
        items: list[ProcessedItem] = []
        start = 0
        # Qwen2-VL: pixel_values are every image's patches, one after another (image_grid_thw counts each one's)
        grids = out.get("image_grid_thw")
        patch_ends = None if grids is None else np.concatenate(([0], np.asarray(grids).prod(-1).cumsum()))
        for i, (count, image) in enumerate(zip(counts, images)):
            span = positions[start:start + count]
            start += count
            if span[-1] - span[0] != count - 1:
                raise InvalidRequestError(FIELD, f"image {i}'s placeholders are not one run of {count} tokens")
            tensors = {}
            for key, value in out.items():
                if key in _TEXT_KEYS:
                    continue
                array = np.asarray(value)
                if key == "pixel_values" and patch_ends is not None and array.shape[0] == patch_ends[-1]:
                    tensors[key] = np.ascontiguousarray(array[patch_ends[i]:patch_ends[i + 1]])
                    continue
                if array.ndim == 0 or array.shape[0] != n:
                    raise InvalidRequestError(FIELD, f"processor output {key!r} of shape {array.shape} is not one "
                                                     f"entry per image ({n})")
                array = array[i:i + 1]
                if key == "pixel_values" and array.ndim == 5:   # any-resolution tiles: the batch's padding dropped
                    array = array[:, :self._num_tiles(_height_width(image), array.shape[1])]
                tensors[key] = np.ascontiguousarray(array)
            items.append(ProcessedItem("image", int(span[0]), count, content_hash(tensors), tensors))
        return ProcessedPrompt(prompt, ids.tolist(), items)

    def _counts(self, images: Sequence[Any], num_placeholders: int) -> list[int]:
        """Each image's placeholder tokens as the processor counts them for its size (transformers'
        ``_get_num_multimodal_tokens``, which vLLM reads too); without it, the placeholders split evenly."""
        count_of = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if count_of is None:
            return [num_placeholders // len(images)] * len(images)
        data = count_of(image_sizes=[_height_width(image) for image in images])
        return [int(c) for c in data.num_image_tokens]

    def _num_tiles(self, size: tuple[int, int], padded: int) -> int:
        """LLaVA-NeXT's tiles of an image of ``size`` (height, width): its grid at the best of the processor's
        ``image_grid_pinpoints``, plus the base tile; ``padded`` (the batch's) when the processor has no grid."""
        from transformers.image_processing_utils import select_best_resolution

        images = self.processor.image_processor
        pinpoints = getattr(images, "image_grid_pinpoints", None)
        crop = getattr(images, "crop_size", None)
        if not pinpoints or not crop:
            return padded
        height, width = select_best_resolution(size, pinpoints)
        return min(padded, -(-height // int(crop["height"])) * -(-width // int(crop["width"])) + 1)
