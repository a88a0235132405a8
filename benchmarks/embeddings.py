"""Embeddings served over HTTP against ``sentence-transformers`` on the same CPU: texts per second.

    python -m benchmarks.embeddings --texts 256 --concurrency 32 --words 64 --batch-size 32 --rounds 2 \\
        --out benchmarks/results/embeddings.json

A BERT-base-shaped random model (hidden 768, 12 layers, 12 heads, mean pooling, Normalize; float32) with its
sentence-transformers files is written once to ``--model-dir``. Its word-level tokenizer makes each text exactly
``--words`` + 2 tokens. ``sluice serve <dir> --dtype float32`` starts and gets a warm-up wave; then each round runs
both sides on the same texts, one after the other (the stack idles while the reference runs):

* ``sentence-transformers``: ``SentenceTransformer.encode(texts, batch_size=--batch-size)`` in this process,
  texts per second over the whole list and this process's CPU seconds per text;
* ``sluice``: ``--concurrency`` clients each sending one text per ``POST /v1/embeddings`` until the list is done,
  texts per second over the wall clock, and each process's CPU seconds in the run (``/proc``): where the time went.

On a machine shared with other work the wall-clock figures move with its load; CPU seconds per text move less.
A few texts' embeddings from both sides are compared (max abs difference printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
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


def make_texts(count: int, words: int, seed: int = 1, min_words: int | None = None) -> list[str]:
    """``count`` texts of ``words`` words each, or of a length drawn uniformly from ``min_words``..``words``."""
    rng = random.Random(seed)
    low = words if min_words is None else min_words
    return [" ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(rng.randint(low, words)))
            for _ in range(count)]


def load_reference(model_dir: Path, texts: list[str], batch_size: int, dtype: str = "float32") -> Any:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    model.encode(texts[:batch_size], batch_size=batch_size)  # warm-up
    return model


def run_reference(model: Any, texts: list[str], batch_size: int) -> tuple[float, float, np.ndarray]:
    """Texts per second of ``SentenceTransformer.encode`` in batches, its CPU seconds per text (every thread of
    this process), and the first texts' vectors."""
    cpu, start = time.process_time(), time.perf_counter()
    vectors = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return len(texts) / wall, cpu / len(texts), vectors[:8]


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


@contextlib.contextmanager
def sluice_stack(model_dir: Path, log: Path, flags: list[str], dtype: str = "float32"
                 ) -> Iterator[tuple[str, int]]:
    """``sluice serve`` of the model: its base URL and process id."""
    from benchmarks.compare import stop, wait_ready
    from common.procs import free_port

    port, engine_port, tokenizer_port = free_port(), free_port(), free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                                 "--port", str(port), "--engine-port", str(engine_port), "--tokenizer-port",
                                 str(tokenizer_port), "--dtype", dtype, *flags],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/ready", 900)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop(proc)


def run_sluice(base: str, pid: int, texts: list[str], concurrency: int) -> tuple[float, dict[str, float]]:
    """Texts per second served over HTTP, and each process's CPU seconds in the run."""
    from benchmarks.overhead import stack_cpu_s

    before = stack_cpu_s(pid)
    wall = asyncio.run(_drive(base, texts, concurrency))
    after = stack_cpu_s(pid)
    return len(texts) / wall, {k: round(after[k] - before.get(k, 0.0), 2) for k in after}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=1024)
    p.add_argument("--words", type=int, default=64, help="words per text (each one token; +2 special tokens)")
    p.add_argument("--min-words", type=int, default=None,
                   help="draw each text's length from --min-words..--words (default: all --words long)")
    p.add_argument("--dtype", default="float32", help="the served model's --dtype")
    p.add_argument("--reference-dtype", default="float32", help="the dtype sentence-transformers loads the model in")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--model-dir", type=Path, default=ROOT / "benchmarks" / "results" / "bert-base-random")
    p.add_argument("--serve-flag", action="append", default=[], help="an extra `sluice serve` flag (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=2, help="rounds of both sides, interleaved")
    args = p.parse_args(argv)
    model_dir = write_model(args.model_dir)
    texts = make_texts(args.texts, args.words, min_words=args.min_words)
    reference = load_reference(model_dir, texts, args.batch_size, args.reference_dtype)
    rounds: list[dict[str, Any]] = []
    with sluice_stack(model_dir, args.model_dir.parent / "embeddings-serve.log", args.serve_flag,
                      args.dtype) as (base, pid):
        import httpx

        asyncio.run(_drive(base, texts[:args.concurrency * 2], args.concurrency))  # warm-up wave
        first = httpx.post(f"{base}/v1/embeddings", json={"input": texts[:8]}, timeout=600).json()
        ours = np.array([d["embedding"] for d in first["data"]])
        for i in range(args.rounds):  # the reference runs while the stack idles
            st_rate, st_cpu, st_vectors = run_reference(reference, texts, args.batch_size)
            rate, cpu = run_sluice(base, pid, texts, args.concurrency)
            ratio = rate / st_rate
            load = os.getloadavg()[0]   # other work on the machine moves the wall-clock figures
            rounds.append({"sentence_transformers_texts_s": st_rate, "sentence_transformers_cpu_s_per_text": st_cpu,
                           "sluice_texts_s": rate, "sluice_cpu_s_per_text": sum(cpu.values()) / len(texts),
                           "sluice_cpu_s": cpu, "ratio": ratio, "load_average_1m": load})
            print(f"round {i}: sentence-transformers {st_rate:.2f} texts/s ({st_cpu:.3f} CPU s/text), sluice over "
                  f"HTTP {rate:.2f} texts/s (c={args.concurrency}; CPU s by process {cpu}): {ratio:.2f}x; "
                  f"load average {load:.1f}", flush=True)
    diff = float(np.abs(ours - st_vectors).max())
    median = statistics.median(r["ratio"] for r in rounds)
    print(f"max |difference| of 8 vectors {diff:.2e}; median ratio sluice / sentence-transformers {median:.2f}x")
    if args.out is not None:
        result: dict[str, Any] = {
            "command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
            "texts": args.texts, "tokens_per_text": args.words + 2, "min_tokens_per_text": (args.min_words or
                                                                                            args.words) + 2,
            "dtype": args.dtype, "reference_dtype": args.reference_dtype, "concurrency": args.concurrency,
            "batch_size": args.batch_size, "rounds": rounds, "max_abs_diff": diff}
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")

if __name__ == "__main__":
    main()
