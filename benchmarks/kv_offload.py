"""KV offload tiers (issue 41): the time to first token of conversations that return after the device KV pool
evicted them, with no tier, a host-memory tier (``native``) and a disk tier, on one random Llama, in one process.

    python -m benchmarks.kv_offload --out benchmarks/results/kv_offload/run.json

Writes a random ``LlamaForCausalLM`` with transformers (no download; ``--hidden``, ``--layers``, heads of 64, 2 KV
heads) and drives ``EngineCore`` (what ``LLM`` wraps) in float32, one engine per mode, each with a device pool of
``--pool-convs`` conversations' worth of blocks:

1. ``--conversations`` first turns, one after another: a distinct ``--prompt``-token system prompt + history each,
   ``--max-tokens`` greedy tokens (the pool evicts the early conversations' blocks while the later ones run);
2. every conversation returns, in the same order, one after another: its first turn, the reply, and a new
   ``--turn``-token user message. The time to first token of each return is measured from ``add_request`` to the
   step that hands back its first token, as are the prompt tokens it found cached.

The tiers are sized to hold every conversation (``--tier-gib``); the disk tier's directory is ``--disk-dir`` (a
fresh temporary directory under it). Files just written are in the OS page cache, so a disk load here reads memory
through the file system plus the entry's checksum; a cold disk adds its read time. The engines run in turn, each
after a warm-up prompt; figures are medians (and the slowest) of the returns.
"""
# ruff: noqa: E402  (the engine's process settings come before torch's import)
from __future__ import annotations

from engine.entrypoints.process import set_openmp_defaults

set_openmp_defaults()   # what the offline LLM does before torch loads

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig, KVOffloadConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams

BLOCK = 16
MODES = ("no tier", "native", "disk")


def write_checkpoint(ns: argparse.Namespace, folder: Path) -> Path:
    cfg = LlamaConfig(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=3 * ns.hidden,
                      num_hidden_layers=ns.layers, num_attention_heads=ns.hidden // 64, num_key_value_heads=2,
                      max_position_embeddings=4 * (ns.prompt + ns.turn + ns.max_tokens), bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(folder / "model"))
    return folder / "model"


def make_core(path: Path, ns: argparse.Namespace, mode: str, disk_dir: Path) -> EngineCore:
    tier = None
    if mode != "no tier":
        tier = KVOffloadConfig(size_gib=ns.tier_gib, backend=mode, path=str(disk_dir) if mode == "disk" else None)
    num_blocks = ns.pool_convs * -(-(ns.prompt + ns.max_tokens + ns.turn) // BLOCK)
    return EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=num_blocks, block_size=BLOCK,
                                   disable_log_stats=True, kv_offloading_config=tier), show_progress=False)


def turn(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, int, list[int]]:
    """(seconds to the first token, prompt tokens found cached, the reply), the request running alone."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    core.add_request(request_id, prompt, sp)
    ttft: float | None = None
    cached, reply = 0, []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
                cached = out.num_cached_tokens
            reply += out.new_token_ids
    assert ttft is not None
    return ttft, cached, reply


def run_mode(path: Path, ns: argparse.Namespace, mode: str, disk_dir: Path) -> dict[str, Any]:
    core = make_core(path, ns, mode, disk_dir)
    try:
        rng = np.random.default_rng(1)
        turn(core, "warm-up", rng.integers(3, ns.vocab, size=ns.prompt).tolist(), 2)
        rng = np.random.default_rng(2)   # the same conversations in every mode
        firsts = [rng.integers(3, ns.vocab, size=ns.prompt).tolist() for _ in range(ns.conversations)]
        news = [rng.integers(3, ns.vocab, size=ns.turn).tolist() for _ in range(ns.conversations)]
        first_ttft, replies = [], []
        for i, prompt in enumerate(firsts):
            ttft, _, reply = turn(core, f"c{i}", prompt, ns.max_tokens)
            first_ttft.append(ttft)
            replies.append(reply)
        back_ttft, cached = [], []
        for i, (prompt, reply, new) in enumerate(zip(firsts, replies, news)):
            ttft, hit, _ = turn(core, f"r{i}", prompt + reply + new, ns.max_tokens)
            back_ttft.append(ttft)
            cached.append(hit / (len(prompt) + len(reply) + len(new)))
        stats = core.scheduler_stats()
        return {"mode": mode, "first_ttft_ms_median": round(1000 * statistics.median(first_ttft), 1),
                "return_ttft_ms_median": round(1000 * statistics.median(back_ttft), 1),
                "return_ttft_ms_max": round(1000 * max(back_ttft), 1),
                "return_cached_fraction_mean": round(statistics.fmean(cached), 3),
                "external_prefix_cache_hits": stats["external_prefix_cache_hits"],
                "external_prefix_cache_queries": stats["external_prefix_cache_queries"],
                "num_blocks": core.num_blocks}
    finally:
        core.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2048, help="tokens of each conversation's first turn")
    p.add_argument("--turn", type=int, default=32, help="tokens of the returning user message")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pool-convs", type=int, default=2, help="conversations the device KV pool holds")
    p.add_argument("--tier-gib", type=float, default=0.25)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--disk-dir", default=None, help="where the disk tier's temporary directory goes")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    ns = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=ns.disk_dir) as disk_dir:
        path = write_checkpoint(ns, Path(tmp))
        for mode in MODES:
            results.append(run_mode(path, ns, mode, Path(disk_dir)))
            print(json.dumps(results[-1]), flush=True)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps({"args": vars(ns), "results": results}, indent=1))


if __name__ == "__main__":
    main()
