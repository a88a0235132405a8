"""LLaVA-1.5 in the engine and the offline API against transformers' own ``LlavaForConditionalGeneration`` and
``LlavaProcessor`` on a tiny random checkpoint: greedy tokens, chunked prefill through an image, the prefix cache
keyed by image hashes, the encoder cache, and the refusals."""
from __future__ import annotations

import base64
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.entrypoints import offline_multimodal
from engine.entrypoints.grpc_multimodal import items_from_pb
from engine.entrypoints.llm import LLM, SamplingParams
from engine.models.loader import load_model
from engine.text.multimodal import ProcessedPrompt
from proto.sluice.v1 import engine_pb2
from tests.engine.executor.checkpoints import write_checkpoint
from tests.engine.models.llava_factory import IMAGE_TOKEN_ID, IMAGE_TOKENS, save_tiny_llava

MAX_TOKENS = 8
# Each sampled token's logprob too: the tiny model's greedy tokens can survive a wrong image embedding (they
# did with each chunk given the first rows of its image), its logprobs cannot.
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
Reference = tuple[list[int], list[float]]


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# Several sizes and aspect ratios: square at the tower's size, wide, tall, larger than the tower.
IMAGES = {"square": _image(32, 32, 1), "wide": _image(80, 30, 2), "tall": _image(20, 64, 3), "big": _image(96, 72, 4)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlavaForConditionalGeneration, Any]:
    path = tmp_path_factory.mktemp("llava")
    model = save_tiny_llava(path)
    return path, model, AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def llm(checkpoint: tuple[Path, Any, Any]) -> LLM:
    return LLM(str(checkpoint[0]), dtype="float32", num_kv_blocks=96, block_size=16)


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


CASES = [
    ("USER: <image>\nw5 w9 w11 ASSISTANT:", ["square"]),
    ("USER: w3 <image>\nw40 w41 ASSISTANT:", ["wide"]),
    ("USER: <image>\nw7 <image>\nw8 w9 ASSISTANT:", ["tall", "big"]),
    ("USER: <image>\n<image>\nw12 ASSISTANT:", ["big", "wide"]),   # two images' placeholders back to back
]


def test_vision_tower_matches_transformers(checkpoint: tuple[Path, Any, Any]) -> None:
    path, model, processor = checkpoint
    ours = load_model(str(path), torch.float32)
    pixels = processor.image_processor(IMAGES["wide"], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                                  vision_feature_select_strategy="default").pooler_output[0]
        got = ours.embed_image({"pixel_values": pixels})  # type: ignore[operator]
    assert got.shape == (IMAGE_TOKENS, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_greedy_matches_transformers(checkpoint: tuple[Path, Any, Any], llm: LLM) -> None:
    prompts = [{"prompt": p, "multi_modal_data": {"image": [IMAGES[k] for k in keys]}} for p, keys in CASES]
    outputs = llm.generate(prompts, GREEDY)
    for (prompt, keys), out in zip(CASES, outputs):
        assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == IMAGE_TOKENS * len(keys)
        _assert_matches(out.outputs[0], _reference(checkpoint, prompt, [IMAGES[k] for k in keys]))
    # One image given alone (not a list), as vLLM takes it.
    single = llm.generate({"prompt": CASES[0][0], "multi_modal_data": {"image": IMAGES["square"]}}, GREEDY)
    _assert_matches(single[0].outputs[0], _reference(checkpoint, CASES[0][0], [IMAGES["square"]]))


def test_chunked_prefill_through_images(checkpoint: tuple[Path, Any, Any]) -> None:
    """Chunks of 8 tokens: every image's 16 placeholders are split over chunks, from its first token or from
    inside; each chunk takes its slice of embeddings computed once."""
    llm = LLM(str(checkpoint[0]), dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=8,
              max_num_seqs=2, enable_prefix_caching=False)
    prompt, keys = CASES[2]
    images = [IMAGES[k] for k in keys]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    _assert_matches(out[0].outputs[0], _reference(checkpoint, prompt, images))
    queries, hits = llm.engine.executor.encoder_cache_stats()
    # 41 prompt tokens in chunks of 8: image 0 (at 3) over 3 chunks, image 1 (at 21) over 3; each encoded once
    assert (queries, hits) == (6, 4)


def test_prefix_cache_keys_blocks_by_image(checkpoint: tuple[Path, Any, Any], llm: LLM) -> None:
    """The same image and text again hits the prefix cache; the same text with another image does not (and gets
    that image's answer, not the cached one's)."""
    prompt = "USER: <image>\nw20 w21 w22 w23 w24 w25 w26 w27 w28 w29 w30 w31 w32 w33 w34 w35 w36 ASSISTANT:"
    stats = llm.engine.scheduler_stats

    def run(image: Image.Image) -> tuple[Any, int]:
        before = stats()["prefix_cache_hits"]
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY)
        return out[0].outputs[0], stats()["prefix_cache_hits"] - before

    first, _ = run(_image(50, 40, 11))
    again, hits = run(_image(50, 40, 11))
    assert again.token_ids == first.token_ids
    assert hits == 32   # the prompt's 38 tokens fill two 16-token blocks, both over the image
    other, hits = run(_image(50, 40, 12))
    assert hits == 0
    _assert_matches(other, _reference(checkpoint, prompt, [_image(50, 40, 12)]))
    _assert_matches(first, _reference(checkpoint, prompt, [_image(50, 40, 11)]))
    _assert_matches(again, _reference(checkpoint, prompt, [_image(50, 40, 11)]))


def test_encoder_cache_hits_counted(llm: LLM) -> None:
    stats = llm.engine.scheduler_stats
    before = stats()
    image = _image(33, 47, 21)
    llm.generate([{"prompt": "USER: <image>\nw5 ASSISTANT:", "multi_modal_data": {"image": image}},
                  {"prompt": "USER: <image>\nw6 ASSISTANT:", "multi_modal_data": {"image": image}}], GREEDY)
    after = stats()
    assert after["encoder_cache_queries"] - before["encoder_cache_queries"] == 2
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 1


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_url_parts(checkpoint: tuple[Path, Any, Any], llm: LLM) -> None:
    images = [IMAGES["tall"], IMAGES["square"]]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(images[0])}},
                                             {"type": "image_url", "image_url": {"url": _data_url(images[1])}},
                                             {"type": "text", "text": "w4 w5 w6"}]}]
    out = llm.chat(messages, GREEDY)
    _, model, processor = checkpoint
    # transformers' own chat path over the same images (a PNG round trip is lossless)
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "image", "image": images[1]},
                                      {"type": "text", "text": "w4 w5 w6"}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert out[0].prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
    tokens = expected.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    _assert_matches(out[0].outputs[0], (tokens, [torch.log_softmax(score[0], -1)[t].item()
                                                 for score, t in zip(expected.scores, tokens)]))
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content\[0\].*does not decode"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "data:image/png;base64,AAAA"}}]}], GREEDY)
    with pytest.raises(InvalidRequestError, match="only data: URLs"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "https://example.com/a.png"}}]}], GREEDY)


def test_limit_mm_per_prompt(checkpoint: tuple[Path, Any, Any]) -> None:
    # the command line's JSON (a dict from Python)
    assert EngineConfig(limit_mm_per_prompt='{"image": 2}').limit_mm_per_prompt == {"image": 2}  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="limit_mm_per_prompt"):
        EngineConfig(limit_mm_per_prompt='{"image": -1}')  # type: ignore[arg-type]
    llm = LLM(str(checkpoint[0]), dtype="float32", num_kv_blocks=32, limit_mm_per_prompt={"image": 1})
    prompt, keys = CASES[2]
    with pytest.raises(InvalidRequestError, match=r"2 image items in one prompt; at most 1.*--limit-mm-per-prompt"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [IMAGES[k] for k in keys]}}, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_free_blocks == 32


def test_text_only_model_refuses_images(tmp_path: Path) -> None:
    path = write_checkpoint("llama", tmp_path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="text-only model: it takes no images") as e:
        llm.generate({"prompt": "w1 w2", "multi_modal_data": {"image": IMAGES["square"]}}, GREEDY)
    assert e.value.field == "multi_modal_data"
    with pytest.raises(InvalidRequestError, match="text-only model"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": _data_url(IMAGES["square"])}}]}], GREEDY)


def _proto_request(processed: ProcessedPrompt) -> engine_pb2.EngineGenerateRequest:
    """What the tokenizer service is to send: the processor's ids and each image's tensors inline."""
    request = engine_pb2.EngineGenerateRequest(request_id="r")
    for it in processed.items:
        item = request.multi_modal_items.add(modality=it.modality, offset=it.offset, length=it.length, hash=it.hash)
        for name, array in it.tensors.items():
            item.tensors[name].CopyFrom(engine_pb2.TensorData(dtype=str(array.dtype), shape=list(array.shape),
                                                              inline=array.tobytes()))
    return request


def _run_core(llm: LLM, rid: str, ids: list[int], items: tuple[Any, ...]) -> list[int]:
    engine = llm.engine
    engine.add_request(rid, ids, GREEDY, mm_items=items)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.new_token_ids]
    return tokens


def test_items_from_the_proto_run_as_the_offline_ones(checkpoint: tuple[Path, Any, Any], llm: LLM) -> None:
    prompt, keys = CASES[2]
    images = [IMAGES[k] for k in keys]
    assert llm.mm_processor is not None
    processed = llm.mm_processor.process(prompt, images)
    items = items_from_pb(_proto_request(processed).multi_modal_items)
    assert _run_core(llm, "proto", processed.prompt_token_ids, items) == _reference(checkpoint, prompt, images)[0]


def test_the_core_refuses_items_that_do_not_fit_the_prompt(llm: LLM) -> None:
    assert llm.mm_processor is not None
    processed = llm.mm_processor.process(CASES[0][0], [IMAGES["square"]])
    ids = processed.prompt_token_ids
    (item,) = offline_multimodal.engine_items(processed)
    engine = llm.engine
    free = engine.scheduler.block_manager.num_free_blocks
    bad = [(replace(item, offset=item.offset + 1), "are not all the image placeholder"),
           (replace(item, length=len(ids)), "outside the prompt"),
           (replace(item, modality="audio"), "'audio' is not supported"),
           (replace(item, hash=""), "a content hash")]
    for wrong, message in bad:
        with pytest.raises(InvalidRequestError, match=message) as e:
            engine.add_request("bad", ids, GREEDY, mm_items=(wrong,))
        assert e.value.field == "multi_modal_data"
    with pytest.raises(InvalidRequestError, match="overlaps"):
        engine.add_request("bad", ids, GREEDY, mm_items=(item, item))
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_free_blocks == free


def test_the_core_refuses_images_the_tower_cannot_take(llm: LLM) -> None:
    """Placeholders of another count than the tower makes, or pixels of another size: refused when added, never
    met by a step."""
    assert llm.mm_processor is not None
    processed = llm.mm_processor.process(CASES[0][0], [IMAGES["square"]])
    (item,) = offline_multimodal.engine_items(processed)
    ids = processed.prompt_token_ids
    short = ids[:item.offset] + ids[item.offset + 4:]   # 12 placeholders for a 16-embedding image
    with pytest.raises(InvalidRequestError, match="12 placeholders for an image the model makes 16 embeddings"):
        llm.engine.add_request("short", short, GREEDY, mm_items=(replace(item, length=12),))
    small = replace(item, tensors={"pixel_values": item.tensors["pixel_values"][..., :16, :16]})
    with pytest.raises(InvalidRequestError, match=r"pixel_values must be a float tensor of shape \[1, 3, 32, 32\]"):
        llm.engine.add_request("small", ids, GREEDY, mm_items=(small,))
    assert not llm.engine.has_unfinished_requests()


def test_a_prefix_hit_that_ends_inside_an_image(checkpoint: tuple[Path, Any, Any], llm: LLM) -> None:
    """The image's placeholders start inside the first 16-token block and end in the second: a second prompt
    sharing only the first block (same image, other text after it) is served tokens [0, 16) from the cache and
    computes the rest of the image from the middle of its embeddings, taken from the encoder cache."""
    image = _image(45, 60, 31)
    head = "USER: w3 w4 w5 w6 w7 w8 w9 w10 <image>\n"
    stats = llm.engine.scheduler_stats
    first = head + "w20 w21 w22 w23 w24 w25 w26 w27 w28 ASSISTANT:"
    llm.generate({"prompt": first, "multi_modal_data": {"image": image}}, GREEDY)
    before = stats()
    second = head + "w40 w41 w42 w43 w44 w45 w46 w47 w48 ASSISTANT:"
    out = llm.generate({"prompt": second, "multi_modal_data": {"image": image}}, GREEDY)
    after = stats()
    offset = out[0].prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert 0 < offset < 16 < offset + IMAGE_TOKENS
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 16
    assert (after["encoder_cache_queries"] - before["encoder_cache_queries"],
            after["encoder_cache_hits"] - before["encoder_cache_hits"]) == (1, 1)
    _assert_matches(out[0].outputs[0], _reference(checkpoint, second, [image]))
