"""Vision-language serving: a random LLaVA-1.5-like checkpoint scaled to a 2-core machine, served by ``sluice serve``
and driven with OpenAI chat requests (one ``data:`` URL image each), against transformers'
``LlavaForConditionalGeneration.generate`` on the same prompts and images, in the same run and dtype.

The checkpoint (written by transformers with its ``LlavaProcessor``): a CLIP-B/14-like tower at 224 px (hidden 768,
12 layers, 12 heads, MLP 3072; 256 image tokens, the CLS position dropped as LLaVA-1.5 does, features of the
second-to-last layer), LLaVA-1.5's two-layer GELU projector, and a Llama language model (hidden 768, 12 layers,
12 heads, MLP 2048, vocabulary 32064 as llava-1.5's): LLaVA-1.5-7B's layout, each side scaled down.
Every request carries an image of its own (seeded, 336x336 random pixels, PNG), so neither the encoder cache nor
the prefix cache hits; each prompt is about 256 image tokens and 30 text tokens, and generates ``--max-tokens``
tokens with EOS ignored.

Per concurrency (1 and 8): Sluice's TTFT p50/p99 (client side, streamed: request sent to the first content delta)
and images per second (requests over the span from the first send to the last completion); transformers' TTFT
(processor plus ``generate`` of one token, batch of 1 or 8) and images per second (processor plus ``generate`` of
``--max-tokens`` tokens, batches of 1 or 8, back to back). The vision tower's share of the engine's time is
measured offline (``LLM.chat`` of a batch of 8 conversations, in this process): the time in the engine's encoder
runner over the time in ``EngineCore.step``.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m benchmarks.vision --out benchmarks/results/vision.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image

from benchmarks.overload import machine, percentile, served

IMAGE_SIZE = 224
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
VOCAB_WORDS = 32000               # the tokenizer's words; the image token follows them
IMAGE_TOKEN_ID = VOCAB_WORDS
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] if part['type'] in ('image', 'image_url') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def save_checkpoint(path: Path, seed: int = 0) -> dict[str, Any]:
    """Write the random LLaVA checkpoint and its processor to ``path``; return its shapes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=512)
    text = LlamaConfig(vocab_size=32064, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=IMAGE_TOKENS, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB_WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", unk_token="w0",
                                   pad_token="w0")
    fast.chat_template = CHAT_TEMPLATE
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=PATCH_SIZE,
                   vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
                   chat_template=CHAT_TEMPLATE).save_pretrained(path)
    fast.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.model.vision_tower.parameters())
    return {"vision": {k: getattr(vision, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                        "num_attention_heads", "image_size", "patch_size")},
            "text": {k: getattr(text, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads")},
            "image_tokens": IMAGE_TOKENS, "params_m": round(params / 1e6, 1), "tower_params_m": round(tower / 1e6, 1)}


def image(seed: int, size: int = 336) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def data_url(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def prompt_text(index: int, words: int = 24) -> str:
    """The request's text: ``words`` vocabulary words picked by ``index``."""
    return " ".join(f"w{(index * 97 + k * 31) % (VOCAB_WORDS - 10) + 10}" for k in range(words))


def chat_body(model: str, url: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request with a single image part, EOS ignored so every request makes
    ``max_tokens`` tokens."""
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def summarize(ttfts: list[float], images: int, span_s: float) -> dict[str, Any]:
    """TTFT p50/p99 (seconds) and images per second over ``span_s``."""
    return {"images": images, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "images_per_s": images / span_s if span_s > 0 else 0.0}


async def _stream(http: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> float:
    sent = time.monotonic()
    ttft: float | None = None
    async with http.stream("POST", url, json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    ttft = time.monotonic() - sent
    if ttft is None:
        raise RuntimeError("no content streamed")
    return ttft


async def sluice_phase(base: str, model: str, requests: list[tuple[str, str]], concurrency: int,
                       max_tokens: int) -> dict[str, Any]:
    """``requests`` (data URL, text) by ``concurrency`` closed-loop clients."""
    url = f"{base}/v1/chat/completions"
    queue = list(reversed(requests))
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        async def worker() -> None:
            while queue:
                image_url, text = queue.pop()
                ttfts.append(await _stream(http, url, chat_body(model, image_url, text, max_tokens)))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return summarize(ttfts, len(requests), time.monotonic() - t0)


def hf_phase(model: Any, processor: Any, requests: list[tuple[Image.Image, str]], batch: int,
             max_tokens: int) -> dict[str, Any]:
    """transformers on the same prompts and images: batches of ``batch``, back to back."""
    def generate(chunk: list[tuple[Image.Image, str]], new_tokens: int) -> None:
        prompts = [f"USER: <image>\n{text}\nASSISTANT:" for _, text in chunk]
        inputs = processor(text=prompts, images=[im for im, _ in chunk], padding=True, return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    chunks = [requests[i:i + batch] for i in range(0, len(requests), batch)]
    ttfts = []
    for chunk in chunks:
        t = time.monotonic()
        generate(chunk, 1)
        ttfts.extend([time.monotonic() - t] * len(chunk))
    t0 = time.monotonic()
    for chunk in chunks:
        generate(chunk, max_tokens)
    return summarize(ttfts, len(requests), time.monotonic() - t0)


@contextmanager
def _timed(owner: Any, name: str, into: list[float]) -> Iterator[None]:
    """Add the seconds of every call of ``owner.name`` to ``into`` while inside."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[0] += time.perf_counter() - t

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def vision_share(path: Path, dtype: str, requests: list[tuple[str, str]], max_tokens: int) -> dict[str, Any]:
    """Offline ``LLM.chat`` of ``requests`` as one batch: seconds in the encoder runner and in engine steps."""
    from engine.core.engine_core import EngineCore
    from engine.entrypoints.llm import LLM, SamplingParams
    from engine.worker.multimodal import EncoderRunner

    llm = LLM(str(path), dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def convs(reqs: list[tuple[str, str]]) -> list[Any]:
        return [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}},
                                              {"type": "text", "text": t}]}] for u, t in reqs]

    llm.chat(convs(requests[:1]), params)   # warm-up, its image not among the timed ones
    encoder, step = [0.0], [0.0]
    with _timed(EncoderRunner, "item_embeddings", encoder), _timed(EngineCore, "step", step):
        llm.chat(convs(requests[1:]), params)
    return {"images": len(requests) - 1, "encoder_s": encoder[0], "step_s": step[0],
            "share": encoder[0] / step[0] if step[0] else None}


def markdown(rows: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    out = ["| side | concurrency | images | TTFT p50 ms | TTFT p99 ms | images/s |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['side']} | {r['concurrency']} | {r['images']} | {ms(r['ttft_p50_s'])} | "
                   f"{ms(r['ttft_p99_s'])} | {r['images_per_s']:.2f} |")
    return "\n".join(out)


def run(args: argparse.Namespace, ckpt: Path, log: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Write the checkpoint to ``ckpt``, then measure: (its shapes, the table's rows, the tower's share)."""
    shapes = save_checkpoint(ckpt)
    print(json.dumps(shapes), flush=True)

    # Distinct seeds everywhere: warm-up, each concurrency, and the offline share run never share an image.
    def make(first: int, n: int) -> list[tuple[Image.Image, str]]:
        return [(image(first + i), prompt_text(first + i)) for i in range(n)]

    sets = {c: make(1000 * (k + 1), args.requests) for k, c in enumerate((1, 8))}
    warm = make(0, 8)
    rows: list[dict[str, Any]] = []
    flags = ["--dtype", args.dtype, "--max-num-seqs", "8", "--kv-cache-memory", "512MiB", *args.serve_flag]
    with served([str(ckpt), *flags], log) as (base, model):
        asyncio.run(sluice_phase(base, model, [(data_url(im), t) for im, t in warm], 8, args.max_tokens))
        for c, reqs in sets.items():
            r = asyncio.run(sluice_phase(base, model, [(data_url(im), t) for im, t in reqs], c, args.max_tokens))
            rows.append({"side": "sluice", "concurrency": c, **r})
            print(json.dumps(rows[-1]), flush=True)
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=getattr(torch, args.dtype)).eval()
    processor = AutoProcessor.from_pretrained(ckpt)
    processor.tokenizer.padding_side = "left"
    hf_phase(hf, processor, warm, 8, 2)
    for c, reqs in sets.items():
        rows.append({"side": "transformers", "concurrency": c, **hf_phase(hf, processor, reqs, c, args.max_tokens)})
        print(json.dumps(rows[-1]), flush=True)
    del hf
    share = vision_share(ckpt, args.dtype, [(data_url(im), t) for im, t in make(50_000, 9)], args.max_tokens)
    print(json.dumps(share), flush=True)
    return shapes, rows, share


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--serve-flag", action="append", default=[], help="further `sluice serve` flags")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    log = (args.out.parent if args.out else Path(".")) / "vision-serve.log"
    with tempfile.TemporaryDirectory(prefix="sluice-vision-") as tmp:
        shapes, rows, share = run(args, Path(tmp) / "llava", log)
    table = markdown(rows)
    print(table)
    if args.out is not None:
        doc = {"command": " ".join(["python -m benchmarks.vision", *(argv if argv is not None else sys.argv[1:])]),
               "machine": machine(), "checkpoint": shapes, "config": vars(args) | {"out": str(args.out)},
               "rows": rows, "vision_share": share, "table": table}
        args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
