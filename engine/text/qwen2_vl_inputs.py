"""Qwen2-VL's processor, for images: transformers' ``Qwen2VLImageProcessor`` (dynamic resolution within the
checkpoint's min / max pixels) loaded from the directory and used directly, the tokenizer and its chat template,
and ``Qwen2VLProcessor``'s placeholder expansion: each ``<|image_pad|>`` of the prompt becomes
``grid_t * grid_h * grid_w / merge_size^2`` of them, one per embedding the model makes of the image.

transformers' ``Qwen2VLProcessor`` itself is not used: it cannot be built without torchvision (its video
processor), and videos are not supported here. This class offers what ``MultiModalProcessor`` calls on a
processor (``__call__``, ``apply_chat_template``, ``tokenizer``, ``chat_template``, ``_get_num_multimodal_tokens``).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

IMAGE_TOKEN = "<|image_pad|>"


class Qwen2VLInputs:
    def __init__(self, model_path: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.chat_template = getattr(self.tokenizer, "chat_template", None) or _processor_template(Path(model_path))
        self.merge_size = int(self.image_processor.merge_size)

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, chat_template: str | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False, **kwargs: Any) -> str:
        """The rendered prompt (text only: ``tokenize`` is ignored); ``kwargs``: the template's variables."""
        return str(self.tokenizer.apply_chat_template(conversation, chat_template=chat_template or self.chat_template,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False,
                                                      **kwargs))

    def __call__(self, *, text: str, images: Sequence[Any] | None = None, return_tensors: str = "np",
                 add_special_tokens: bool = True) -> dict[str, np.ndarray]:
        """``{input_ids [1, L], pixel_values [patches, patch_dim], image_grid_thw [images, 3]}`` (the pixel
        entries only with images). ValueError when the prompt's ``<|image_pad|>`` count is not the images'."""
        images = list(images or ())
        found = text.count(IMAGE_TOKEN)
        if found != len(images):
            raise ValueError(f"the prompt has {found} {IMAGE_TOKEN} placeholders for {len(images)} images")
        out: dict[str, np.ndarray] = {}
        if images:
            pixels = self.image_processor(images=images, return_tensors="np")
            out["pixel_values"] = np.asarray(pixels["pixel_values"])
            out["image_grid_thw"] = np.asarray(pixels["image_grid_thw"])
            pieces = text.split(IMAGE_TOKEN)
            counts = (out["image_grid_thw"].prod(-1) // self.merge_size ** 2).tolist()
            text = pieces[0] + "".join(IMAGE_TOKEN * int(n) + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        out["input_ids"] = np.asarray([ids], dtype=np.int64)
        return out

    def _get_num_multimodal_tokens(self, image_sizes: Sequence[tuple[int, int]]) -> SimpleNamespace:
        """Each image's placeholders for its (height, width), as ``Qwen2VLProcessor`` counts them."""
        patches = [self.image_processor.get_number_of_image_patches(h, w, {}) for h, w in image_sizes]
        return SimpleNamespace(num_image_tokens=[p // self.merge_size ** 2 for p in patches])


def _processor_template(directory: Path) -> str | None:
    """The chat template of the processor's ``chat_template.json`` (the hub's Qwen2-VL checkpoints carry one)."""
    path = directory / "chat_template.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("chat_template")
    return value if isinstance(value, str) else None
