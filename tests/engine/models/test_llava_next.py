"""LLaVA-NeXT's any-resolution tiling against transformers' ``LlavaNextForConditionalGeneration`` and
``LlavaNextProcessor`` on a tiny random checkpoint: images of different sizes make different numbers of
placeholders, each checked to the token."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaNextForConditionalGeneration

from engine.entrypoints.llm import LLM, SamplingParams
from engine.models.loader import load_model
from tests.engine.models.llava_factory import IMAGE_TOKEN_ID, save_tiny_llava_next

MAX_TOKENS = 8
# Each sampled token's logprob too: the tiny model's greedy tokens can survive a wrong image embedding (they
# did with each chunk given the first rows of its image), its logprobs cannot.
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
Reference = tuple[list[int], list[float]]


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# wide (a 1x2 grid, unpadded rows dropped), tall (2x1, columns dropped), square (2x2), very wide (1x3)
IMAGES = {"wide": _image(80, 30, 1), "tall": _image(20, 64, 2), "square": _image(50, 50, 3),
          "long": _image(120, 36, 4)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlavaNextForConditionalGeneration, Any]:
    path = tmp_path_factory.mktemp("llava_next")
    model = save_tiny_llava_next(path)
    return path, model, AutoProcessor.from_pretrained(path)


def _reference(checkpoint: tuple[Path, Any, Any], prompt: str, images: list[Image.Image]) -> Reference:
    """transformers' greedy tokens for the prompt and its images, through the model's processor, and each one's
    logprob."""
    _, model, processor = checkpoint
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]


def _assert_matches(completion: Any, reference: Reference) -> None:
    assert completion.token_ids == reference[0]
    got = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    np.testing.assert_allclose(got, reference[1], atol=1e-3)


def test_tiles_pack_as_transformers_packs_them(checkpoint: tuple[Path, Any, Any]) -> None:
    path, model, processor = checkpoint
    ours = load_model(str(path), torch.float32)
    images = list(IMAGES.values())
    inputs = processor(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_sizes=inputs["image_sizes"], vision_feature_layer=-2,
                                                  vision_feature_select_strategy="default").pooler_output
        for i, want in enumerate(expected):
            tensors = {"pixel_values": inputs["pixel_values"][i:i + 1], "image_sizes": inputs["image_sizes"][i:i + 1]}
            got = ours.embed_image(tensors)  # type: ignore[operator]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert ours.image_tokens(tensors) == len(want)  # type: ignore[operator]  # what admission checks
    assert len({len(e) for e in expected}) == len(images)   # every size makes its own number of placeholders


CASES = [
    ("USER: <image>\nw5 w9 ASSISTANT:", ["wide"]),
    ("USER: <image>\nw7 <image>\nw8 ASSISTANT:", ["tall", "square"]),
    ("USER: w3 <image>\n<image>\nw12 ASSISTANT:", ["long", "wide"]),
]


@pytest.mark.parametrize("budget", [2048, 24], ids=["whole", "chunked"])
def test_greedy_matches_transformers(checkpoint: tuple[Path, Any, Any], budget: int) -> None:
    llm = LLM(str(checkpoint[0]), dtype="float32", num_kv_blocks=96, block_size=16, max_num_batched_tokens=budget,
              max_num_seqs=4)
    prompts = [{"prompt": p, "multi_modal_data": {"image": [IMAGES[k] for k in keys]}}
               for p, keys in CASES]
    outputs = llm.generate(prompts, GREEDY)
    for (prompt, keys), out in zip(CASES, outputs):
        images = [IMAGES[k] for k in keys]
        assert IMAGE_TOKEN_ID in out.prompt_token_ids
        _assert_matches(out.outputs[0], _reference(checkpoint, prompt, images))
    # "wide" came twice, each time with other companions (other batch padding of the tiles): one hash, one encoding
    stats = llm.engine.scheduler_stats()
    assert stats["encoder_cache_hits"] >= 1
