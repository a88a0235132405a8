"""Qwen2-VL in the engine and the offline API against transformers' own ``Qwen2VLForConditionalGeneration`` and
``Qwen2VLImageProcessor`` on a tiny random checkpoint: the vision transformer, M-RoPE positions against
``get_rope_index``, greedy tokens and logprobs for one and two images of several sizes and for text alone, chunked
prefill through images, the prefix cache keyed by image hashes, and the refusals."""
from __future__ import annotations

import base64
import io
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

from common.errors import InvalidRequestError
from engine.entrypoints import offline_multimodal
from engine.entrypoints.llm import LLM, SamplingParams
from engine.models.loader import load_model
from engine.models.qwen2_vl import qwen2_vl_config_from_hf
from engine.worker.mrope import request_positions
from tests.engine.models.qwen2_vl_factory import IMAGE_TOKEN_ID, MERGE_SIZE, save_tiny_qwen2_vl

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
Reference = tuple[list[int], list[float]]
Checkpoint = tuple[Path, Qwen2VLForConditionalGeneration, Any]


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# Square (4x4 patches), wide (6x8: 84x112), tall, and one the max_pixels bound scales down.
IMAGES = {"square": _image(56, 56, 1), "wide": _image(112, 84, 2), "tall": _image(60, 100, 3),
          "big": _image(200, 150, 4)}
CASES = [
    (f"<|im_start|>user\n{IMAGE}w5 w9 w11<|im_end|>\n<|im_start|>assistant\n", ["square"]),
    (f"<|im_start|>user\nw3 {IMAGE}w40 w41 {IMAGE}w7<|im_end|>\n<|im_start|>assistant\n", ["square", "wide"]),
    (f"<|im_start|>user\n{IMAGE}{IMAGE}w12<|im_end|>\n<|im_start|>assistant\n", ["tall", "big"]),
    ("<|im_start|>user\nw3 w4 w5 w6<|im_end|>\n<|im_start|>assistant\n", []),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = tmp_path_factory.mktemp("qwen2_vl")
    model = save_tiny_qwen2_vl(path)
    return path, model, AutoImageProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def llm(checkpoint: Checkpoint) -> LLM:
    return LLM(str(checkpoint[0]), dtype="float32", num_kv_blocks=96, block_size=16)


def _reference_inputs(checkpoint: Checkpoint, prompt: str, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    """transformers' inputs: its image processor's pixels and grids, each ``<|image_pad|>`` expanded to
    grid_t * grid_h * grid_w / merge^2 tokens (``Qwen2VLProcessor.replace_image_token``)."""
    path, model, image_processor = checkpoint
    inputs: dict[str, torch.Tensor] = {}
    if images:
        pixels = image_processor(images=images, return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        for grid in pixels["image_grid_thw"]:
            prompt = prompt.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // MERGE_SIZE ** 2), 1)
        prompt = prompt.replace("<|placeholder|>", "<|image_pad|>")
    from transformers import AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]])
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int())
    return inputs


def _reference(checkpoint: Checkpoint, prompt: str, images: list[Image.Image]) -> Reference:
    inputs = _reference_inputs(checkpoint, prompt, images)
    with torch.no_grad():
        out = checkpoint[1].generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                     return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]


def _assert_matches(completion: Any, reference: Reference) -> None:
    assert completion.token_ids == reference[0]
    got = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
    np.testing.assert_allclose(got, reference[1], atol=1e-3)


def test_vision_transformer_matches_transformers(checkpoint: Checkpoint) -> None:
    path, model, image_processor = checkpoint
    ours = load_model(str(path), torch.float32)
    pixels = image_processor(images=[IMAGES["wide"]], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 6, 8]]
    with torch.no_grad():
        expected = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"]).pooler_output[0]
        got = ours.embed_image(dict(pixels))  # type: ignore[operator]
    assert got.shape == (12, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_mrope_positions_match_get_rope_index(checkpoint: Checkpoint, llm: LLM) -> None:
    """Every token's (t, h, w) position, and a decode token's (its rope delta), as transformers computes them."""
    prompt, keys = CASES[1]
    images = [IMAGES[k] for k in keys]
    inputs = _reference_inputs(checkpoint, prompt, images)
    expected, deltas = checkpoint[1].model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                          image_grid_thw=inputs["image_grid_thw"])
    assert llm.mm_processor is not None
    processed = llm.mm_processor.process(prompt, images)
    assert processed.prompt_token_ids == inputs["input_ids"][0].tolist()
    items = offline_multimodal.engine_items(processed)
    model = llm.engine.executor.worker.model   # type: ignore[attr-defined]
    n = len(processed.prompt_token_ids)
    got = request_positions(items, np.arange(n + 3), model.mrope_grid)
    np.testing.assert_array_equal(got[:, :n], expected[:, 0].numpy())
    decode = np.arange(n, n + 3) + int(deltas[0, 0])
    np.testing.assert_array_equal(got[:, n:], np.stack([decode] * 3))


def test_greedy_matches_transformers(checkpoint: Checkpoint, llm: LLM) -> None:
    """One image, two of different sizes and aspect ratios (text between them, and back to back), text alone."""
    prompts = [{"prompt": p, "multi_modal_data": {"image": [IMAGES[k] for k in keys]}} if keys else p
               for p, keys in CASES]
    outputs = llm.generate(prompts, GREEDY)
    for (prompt, keys), out in zip(CASES, outputs):
        reference_ids = _reference_inputs(checkpoint, prompt, [IMAGES[k] for k in keys])["input_ids"]
        assert out.prompt_token_ids == reference_ids[0].tolist()
        _assert_matches(out.outputs[0], _reference(checkpoint, prompt, [IMAGES[k] for k in keys]))


def test_chunked_prefill_through_images(checkpoint: Checkpoint) -> None:
    """Chunks of 5 tokens: each image's placeholders are split over chunks, each chunk with its slice of the
    embeddings and of the M-RoPE positions."""
    llm = LLM(str(checkpoint[0]), dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=5,
              max_num_seqs=2, enable_prefix_caching=False)
    prompt, keys = CASES[1]
    images = [IMAGES[k] for k in keys]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    _assert_matches(out[0].outputs[0], _reference(checkpoint, prompt, images))
    queries, hits = llm.engine.executor.encoder_cache_stats()
    assert hits > 0 and queries - hits == 2   # each image encoded once


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_url_parts(checkpoint: Checkpoint, llm: LLM) -> None:
    """The tokenizer's chat template puts each image part in its place; the answer is transformers'."""
    images = [IMAGES["tall"], IMAGES["square"]]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(images[0])}},
                                             {"type": "text", "text": "w4 w5"},
                                             {"type": "image_url", "image_url": {"url": _data_url(images[1])}},
                                             {"type": "text", "text": "w6"}]}]
    out = llm.chat(messages, GREEDY)
    prompt = f"<|im_start|>user\n{IMAGE}w4 w5{IMAGE}w6<|im_end|>\n<|im_start|>assistant\n"
    assert out[0].prompt_token_ids == _reference_inputs(checkpoint, prompt, images)["input_ids"][0].tolist()
    _assert_matches(out[0].outputs[0], _reference(checkpoint, prompt, images))


def test_prefix_cache_keys_blocks_by_image(checkpoint: Checkpoint, llm: LLM) -> None:
    """The same text with another image hits only the full blocks of text before the image; the same image again
    hits the blocks over it and after it, and the tokens computed after the hit get their M-RoPE positions."""
    head = "<|im_start|>user\nw20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31 w32 w33 w34 w35 w36 w37 "
    prompt = head + f"{IMAGE}w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51 w52 w53<|im_end|>\n<|im_start|>assistant\n"
    stats = llm.engine.scheduler_stats

    def run(image: Image.Image) -> tuple[Any, int]:
        before = stats()["prefix_cache_hits"]
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY)
        return out[0], stats()["prefix_cache_hits"] - before

    first, _ = run(_image(70, 56, 11))   # resized to 56x56: 4x4 patches, 4 placeholders
    offset = first.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert 16 < offset < 32
    again, hits = run(_image(70, 56, 11))
    assert hits == len(first.prompt_token_ids) // 16 * 16
    other, hits = run(_image(70, 56, 12))
    assert hits == 16   # the first block: text only
    for out, seed in ((first, 11), (again, 11), (other, 12)):
        _assert_matches(out.outputs[0], _reference(checkpoint, prompt, [_image(70, 56, seed)]))


def test_the_core_refuses_grids_that_do_not_fit(llm: LLM) -> None:
    assert llm.mm_processor is not None
    processed = llm.mm_processor.process(CASES[0][0], [IMAGES["square"]])
    (item,) = offline_multimodal.engine_items(processed)
    ids = processed.prompt_token_ids
    free = llm.engine.scheduler.block_manager.num_free_blocks
    wrong_grid = replace(item, tensors={**item.tensors, "image_grid_thw": torch.tensor([[1, 4, 8]])})
    with pytest.raises(InvalidRequestError, match=r"pixel_values must be a float tensor of shape \[32, 1176\]"):
        llm.engine.add_request("grid", ids, GREEDY, mm_items=(wrong_grid,))
    odd = replace(item, tensors={**item.tensors, "image_grid_thw": torch.tensor([[1, 3, 4]])})
    with pytest.raises(InvalidRequestError, match="multiples of 2"):
        llm.engine.add_request("odd", ids, GREEDY, mm_items=(odd,))
    with pytest.raises(InvalidRequestError, match="placeholders"):
        llm.mm_processor.process(CASES[0][0], [IMAGES["square"], IMAGES["wide"]])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_free_blocks == free


def test_qwen2_5_vl_is_refused_by_name(checkpoint: Checkpoint, tmp_path: Path) -> None:
    shutil.copytree(checkpoint[0], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_5_vl"}))
    with pytest.raises(ValueError, match="Qwen2.5-VL .*window attention.* not supported"):
        load_model(str(tmp_path / "m"), torch.float32)


def test_the_hubs_flat_config_reads_as_transformers_5s(checkpoint: Checkpoint) -> None:
    """Qwen/Qwen2-VL-*'s config.json: the language model's fields at the top, ``rope_scaling: {type: mrope}``,
    the vision transformer's ``in_chans``."""
    nested = json.loads((checkpoint[0] / "config.json").read_text())
    text = nested["text_config"]
    rope = text["rope_parameters"]
    flat = {**{k: v for k, v in text.items() if k != "rope_parameters"}, "model_type": "qwen2_vl",
            "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "image_token_id": nested["image_token_id"],
            "vision_config": {**{k: v for k, v in nested["vision_config"].items() if k != "in_channels"},
                              "in_chans": 3}}
    assert qwen2_vl_config_from_hf(flat) == qwen2_vl_config_from_hf(nested)
    assert qwen2_vl_config_from_hf(nested)[0].mrope_section == (2, 3, 3)
