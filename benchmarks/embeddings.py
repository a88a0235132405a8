"""Embeddings served over HTTP against ``sentence-transformers`` on the same CPU: texts per second.

    python -m benchmarks.embeddings --texts 1024 --concurrency 32 --words 64 --batch-size 32 \\
        --out benchmarks/results/embeddings.json

A BERT-base-shaped random model (hidden 768, 12 layers, 12 heads, mean pooling, Normalize; float32) with its
sentence-transformers files is written once to ``--model-dir``. Its word-level tokenizer makes each text exactly
``--words`` + 2 tokens. Then, one side after the other on the same machine:

* ``sentence-transformers``: ``SentenceTransformer.encode(texts, batch_size=--batch-size)`` in this process (after
  one warm-up batch), texts per second over the whole list;
* ``sluice``: ``sluice serve <dir> --dtype float32``, ``--concurrency`` clients each sending one text per
  ``POST /v1/embeddings`` until the list is done (after a warm-up wave), texts per second over the wall clock,
  and each process's CPU seconds in the run (``/proc``), which say where the time went.

A few texts' embeddings from both sides are compared (max abs difference printed) before the figures count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB_WORDS = 4000


def write_model(path: Path, seed: int = 0) -> Path:
    """The BERT-base-shaped embedder, unless ``path`` holds it already."""
    if (path / "modules.json").is_file():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(VOCAB_WORDS)])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=512).save_pretrained(path)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0)
    BertModel(config).eval().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 768, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    return path


def make_texts(count: int, words: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(words)) for _ in range(count)]


def run_reference(model_dir: Path, texts: list[str], batch_size: int) -> tuple[float, np.ndarray]:
    """Texts per second of ``SentenceTransformer.encode`` in batches, and the first texts' vectors."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.encode(texts[:batch_size], batch_size=batch_size)  # warm-up
    start = time.perf_counter()
    vectors = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
    return len(texts) / (time.perf_counter() - start), vectors[:8]


async def _drive(base: str, texts: list[str], concurrency: int) -> float:
    import httpx

    queue = list(reversed(texts))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits, trust_env=False) as client:
        async def worker() -> None:
            while queue:
                r = await client.post("/v1/embeddings", json={"input": queue.pop()})
                r.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def run_sluice(model_dir: Path, texts: list[str], concurrency: int, log: Path, flags: list[str]
               ) -> tuple[float, np.ndarray, dict[str, float]]:
    """Texts per second served over HTTP, the first texts' vectors, and each process's CPU seconds in the run."""
    import httpx

    from benchmarks.compare import stop, wait_ready
    from benchmarks.overhead import stack_cpu_s
    from common.procs import free_port

    port, engine_port, tokenizer_port = free_port(), free_port(), free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                                 "--port", str(port), "--engine-port", str(engine_port), "--tokenizer-port",
                                 str(tokenizer_port), "--dtype", "float32", *flags],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(proc, f"{base}/ready", 900)
        asyncio.run(_drive(base, texts[:concurrency * 2], concurrency))  # warm-up wave
        first = httpx.post(f"{base}/v1/embeddings", json={"input": texts[:8]}, timeout=600).json()
        vectors = np.array([d["embedding"] for d in first["data"]])
        before = stack_cpu_s(proc.pid)
        wall = asyncio.run(_drive(base, texts, concurrency))
        after = stack_cpu_s(proc.pid)
        return len(texts) / wall, vectors, {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=1024)
    p.add_argument("--words", type=int, default=64, help="words per text (each one token; +2 special tokens)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--model-dir", type=Path, default=ROOT / "benchmarks" / "results" / "bert-base-random")
    p.add_argument("--serve-flag", action="append", default=[], help="an extra `sluice serve` flag (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    model_dir = write_model(args.model_dir)
    texts = make_texts(args.texts, args.words)
    st_rate, st_vectors = run_reference(model_dir, texts, args.batch_size)
    print(f"sentence-transformers: {st_rate:.1f} texts/s (batch {args.batch_size})", flush=True)
    log = args.model_dir.parent / "embeddings-serve.log"
    rate, vectors, cpu = run_sluice(model_dir, texts, args.concurrency, log, args.serve_flag)
    diff = float(np.abs(vectors - st_vectors).max())
    print(f"sluice over HTTP: {rate:.1f} texts/s (c={args.concurrency}); CPU s by process {cpu}")
    print(f"ratio sluice / sentence-transformers: {rate / st_rate:.2f}x; max |difference| of 8 vectors {diff:.2e}")
    if args.out is not None:
        result: dict[str, Any] = {
            "command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
            "texts": args.texts, "tokens_per_text": args.words + 2, "concurrency": args.concurrency,
            "batch_size": args.batch_size, "sentence_transformers_texts_s": st_rate, "sluice_texts_s": rate,
            "ratio": rate / st_rate, "cpu_s": cpu, "max_abs_diff": diff}
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
