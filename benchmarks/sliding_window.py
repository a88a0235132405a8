"""Sliding windows (issue 38): the KV blocks a sequence holds and the decode step time with block reclaim on and off,
and a 32k-token prompt's prefill against transformers, on one tiny random Mistral, in one process.

    python -m benchmarks.sliding_window --out benchmarks/results/sliding_window/run.json

Writes a random ``MistralForCausalLM`` with transformers (no download; every layer slides, ``--window`` 1024,
``max_position_embeddings`` 32768; hidden ``--hidden`` with query heads of 128 and 2 KV heads) and the same weights
with ``sliding_window: null`` (full attention), and drives ``EngineCore`` (what ``LLM`` wraps) in the dtype the
engine picks (``--dtype auto``: bfloat16 with AVX512-BF16 or AMX, else float32):

- **reclaim on**: the engine as it is: every layer slides, so the scheduler gives back the blocks behind the window
  (``Scheduler.reclaim_window``, set from ``EngineCore._reclaim_window``);
- **reclaim off**: the same engine with ``core.scheduler.reclaim_window = None`` after it is built. No engine setting
  turns reclaim off alone (``--disable-sliding-window`` also turns the window off and caps the context at it);
- **full attention**: the ``sliding_window: null`` checkpoint. What ``--disable-sliding-window`` computes, which
  itself refuses contexts past the window (1024), so it cannot run 8k.

Each engine is warmed up on one 2048-token prompt, then prefills ``--num-seqs`` distinct prompts of ``--context``
tokens (chunked, ``max_num_batched_tokens`` 2048, the default; the first sequences decode while the later ones
prefill), then all three decode in interleaved rounds of ``--steps`` steps (``--rounds``, the first dropped; greedy,
``ignore_eos``); a step's time is ``core.step()``'s wall time, its host part the engine's own ``StepStats``
(schedule + prepare + update), figures are medians. After the rounds, the KV blocks each sequence holds are
counted from the block manager (its table entries that are not ``RELEASED``), and the pool's blocks in use beside
them (blocks given back wait as evictable prefix-cache entries, which the engine counts as free); the sequences are
then aborted.

Then one prompt of ``--long`` tokens is prefilled by the reclaim-on engine and the full-attention one (the time to
its first token), and by transformers' ``MistralForCausalLM`` (its default attention, sdpa, with its sliding-window
mask) in one forward of the whole prompt (``logits_to_keep=1``, no cache), in the same dtype, after a short warm-up;
then the reclaim-on engine prefills another prompt of the same length, a bracket on the machine's drift during
transformers' long forward.
The process is set up as ``LLM`` sets it (``set_openmp_defaults``) before torch loads.
"""
# ruff: noqa: E402  (the engine's process settings come before torch's import)
from __future__ import annotations

from engine.entrypoints.process import set_openmp_defaults

set_openmp_defaults()   # what the offline LLM does before torch loads

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import MistralConfig, MistralForCausalLM

from engine.config import EngineConfig
from engine.core.block_manager import RELEASED
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.models.dtype import resolve_dtype

BLOCK = 16
HEAD_DIM = 128
MODES = ("reclaim on", "reclaim off", "full attention")


def write_checkpoints(ns: argparse.Namespace, folder: Path, dtype: torch.dtype) -> tuple[Path, Path]:
    """The sliding-window checkpoint and a copy of it with ``sliding_window: null``."""
    cfg = MistralConfig(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=3 * ns.hidden,
                        num_hidden_layers=ns.layers, num_attention_heads=ns.hidden // HEAD_DIM, num_key_value_heads=2,
                        head_dim=HEAD_DIM, max_position_embeddings=ns.long, sliding_window=ns.window,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        MistralForCausalLM(cfg).eval().save_pretrained(str(folder / "sliding"))
    finally:
        torch.set_default_dtype(default)
    shutil.copytree(folder / "sliding", folder / "full")
    config_file = folder / "full" / "config.json"
    hf_config = json.loads(config_file.read_text())
    hf_config["sliding_window"] = None
    config_file.write_text(json.dumps(hf_config))
    return folder / "sliding", folder / "full"


def make_core(path: Path, ns: argparse.Namespace, dtype: torch.dtype, num_blocks: int) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype=str(dtype).removeprefix("torch."), max_num_seqs=ns.num_seqs,
                                   num_kv_blocks=num_blocks, disable_log_stats=True), show_progress=False)


def block_bytes(core: EngineCore) -> int:
    mc = core.model_config
    element = resolve_dtype(core.executor.kv_cache_dtype_name).itemsize
    return 2 * mc.num_layers * BLOCK * mc.num_kv_heads * mc.head_dim * element


def pool_in_use(core: EngineCore) -> int:
    """Blocks of the pool held by requests (cached blocks no sequence holds count as free)."""
    return core.num_blocks - core.scheduler.block_manager.num_free_blocks


def held_blocks(core: EngineCore) -> list[int]:
    """Blocks each running sequence holds: its table less the entries given back."""
    return [sum(1 for b in r.block_ids if b != RELEASED) for r in core.scheduler.running]


def prefill(core: EngineCore, prompts: np.ndarray, max_tokens: int) -> dict[str, Any]:
    """Adds every prompt and steps until each has its first token; the most blocks a sequence held between steps."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add_request(f"s{i}", ids, sp)
    started: set[str] = set()
    peak_seq = peak_pool = 0
    while len(started) < len(prompts):
        started.update(o.request_id for o in core.step() if o.new_token_ids)
        peak_seq = max(peak_seq, *held_blocks(core))
        peak_pool = max(peak_pool, pool_in_use(core))
    seconds = time.perf_counter() - t0
    return {"prefill_s": round(seconds, 1), "prefill_tok_s": round(prompts.size / seconds),
            "peak_blocks_per_seq_in_prefill": peak_seq, "peak_pool_blocks_in_prefill": peak_pool}


def warm_up(core: EngineCore, vocab: int) -> None:
    """One 2048-token prompt and a few decode steps: the process's first prefill and decode pay oneDNN's primitive
    creation, which the engine built first would otherwise pay alone."""
    ids = np.random.default_rng(2).integers(3, vocab, size=2048, dtype=np.int64)
    core.add_request("warm-up", ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()


def decode_steps(core: EngineCore, steps: int, num_seqs: int) -> tuple[list[float], list[float]]:
    """Wall ms of each step, and its host part (schedule + prepare + update, as the engine measures it)."""
    times, host = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(1000 * (time.perf_counter() - t0))
        st = core.last_step
        assert st is not None and st.num_batched_tokens == num_seqs, "not a decode step"
        host.append(1000 * (st.schedule_s + st.prepare_s + st.update_s))
    return times, host


def sluice_long_prefill(core: EngineCore, ids: np.ndarray) -> float:
    """Seconds from adding one prompt to its first token."""
    t0 = time.perf_counter()
    core.add_request("long", ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - t0


def hf_long_prefill(path: Path, dtype: torch.dtype, ids: np.ndarray) -> float:
    model = MistralForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.inference_mode():
        model(input_ids=torch.from_numpy(ids[:2048])[None], use_cache=False, logits_to_keep=1)   # warm-up
        t0 = time.perf_counter()
        model(input_ids=torch.from_numpy(ids)[None], use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sliding_window", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--context", type=int, default=8192, help="prompt tokens of each decoding sequence")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=512, help="hidden size: hidden/128 query heads, 2 KV heads")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="decode steps of each engine per round")
    p.add_argument("--long", type=int, default=32768, help="the long prompt (and max_position_embeddings)")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 with avx512_bf16 or AMX, else float32")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' long prefill")
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    dtype = resolve_dtype(ns.dtype)
    tmp = tempfile.TemporaryDirectory()
    sliding, full = write_checkpoints(ns, Path(tmp.name), dtype)
    # A sequence decodes while the ones after it prefill (a step's 2048 tokens serve decodes first: at most two steps
    # per 2048-token chunk of the others), then in the rounds; all are aborted after them.
    max_tokens = 2 * ns.num_seqs * -(-ns.context // 2048) + ns.rounds * ns.steps + 1
    # Room for every sequence's whole context: reclaim off and full attention hold it all.
    num_blocks = max(ns.num_seqs * -(-(ns.context + max_tokens) // BLOCK), -(-ns.long // BLOCK)) + 8
    cores = {"reclaim on": make_core(sliding, ns, dtype, num_blocks),
             "reclaim off": make_core(sliding, ns, dtype, num_blocks),
             "full attention": make_core(full, ns, dtype, num_blocks)}
    assert cores["reclaim on"].scheduler.reclaim_window == ns.window
    cores["reclaim off"].scheduler.reclaim_window = None   # no engine setting turns reclaim off alone
    assert cores["full attention"].scheduler.reclaim_window is None
    per_block = block_bytes(cores["reclaim on"])
    prompts = np.random.default_rng(0).integers(3, ns.vocab, size=(ns.num_seqs, ns.context), dtype=np.int64)

    for core in cores.values():
        warm_up(core, ns.vocab)
    rows: dict[str, dict[str, Any]] = {}
    for mode, core in cores.items():
        rows[mode] = prefill(core, prompts, max_tokens)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    host: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(ns.rounds):
        for mode, core in cores.items():
            step_ms, host_ms = decode_steps(core, ns.steps, ns.num_seqs)
            if r:   # round 0 warms up each engine's decode path
                times[mode] += step_ms
                host[mode] += host_ms
    held = {mode: held_blocks(core) for mode, core in cores.items()}
    assert all(len(h) == ns.num_seqs for h in held.values()), "a sequence ended before the snapshot"
    pool = {mode: pool_in_use(core) for mode, core in cores.items()}
    lengths = [r.num_tokens for r in cores["reclaim on"].scheduler.running]
    for core in cores.values():
        core.abort_requests([f"s{i}" for i in range(ns.num_seqs)])
        while core.has_unfinished_requests():   # reports the aborts
            core.step()
    for mode in MODES:
        rows[mode].update({
            "decode_ms_per_step": round(statistics.median(times[mode]), 2),
            "decode_ms_min_max": [round(min(times[mode]), 2), round(max(times[mode]), 2)],
            "host_ms_per_step": round(statistics.median(host[mode]), 2),
            "blocks_per_seq_mean": round(statistics.mean(held[mode]), 1), "blocks_per_seq_max": max(held[mode]),
            "kv_mib_per_seq": round(statistics.mean(held[mode]) * per_block / 2**20, 2),
            "pool_blocks_in_use": pool[mode], "pool_kv_mib_in_use": round(pool[mode] * per_block / 2**20, 1)})
    on, off = rows["reclaim on"], rows["reclaim off"]
    ratios = {"on_over_off_decode_ms": round(on["decode_ms_per_step"] / off["decode_ms_per_step"], 3),
              "on_over_off_kv_bytes_per_seq": round(on["blocks_per_seq_mean"] / off["blocks_per_seq_mean"], 3),
              "on_over_full_decode_ms": round(on["decode_ms_per_step"] / rows["full attention"]["decode_ms_per_step"],
                                              3)}

    # Distinct prompts: a prompt seen before would hit the prefix cache (blocks given back stay registered).
    long_ids, again_ids = np.random.default_rng(1).integers(3, ns.vocab, size=(2, ns.long), dtype=np.int64)
    long: dict[str, float] = {}
    for mode in ("reclaim on", "full attention"):
        long[f"sluice {mode}"] = sluice_long_prefill(cores[mode], long_ids)
    windowed = cores.pop("reclaim on")
    for core in cores.values():
        core.close()
    del cores
    gc.collect()
    if not ns.no_hf:
        long["transformers"] = hf_long_prefill(sliding, dtype, long_ids)
        # once more after transformers' minute-long forward: a bracket on the machine's drift
        long["sluice reclaim on, after transformers"] = sluice_long_prefill(windowed, again_ids)
    windowed.close()
    tmp.cleanup()
    long_rows = {name: {"seconds": round(s, 2), "tok_s": round(ns.long / s)} for name, s in long.items()}
    if not ns.no_hf:
        for name in ("sluice reclaim on", "sluice reclaim on, after transformers"):
            long_rows[name]["over_transformers"] = round(long["transformers"] / long[name], 2)

    result: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.sliding_window", *(argv if argv is not None else sys.argv[1:])]),
        "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "model": f"mistral, {ns.layers} layers, hidden {ns.hidden}, {ns.hidden // HEAD_DIM} query / 2 KV heads of "
                 f"{HEAD_DIM}, intermediate {3 * ns.hidden}, vocab {ns.vocab}, sliding_window {ns.window}",
        "num_seqs": ns.num_seqs, "context": ns.context, "tokens_per_seq_at_snapshot": [min(lengths), max(lengths)],
        "kv_bytes_per_block": per_block, "pool_blocks": num_blocks, "decode_steps_timed": len(times["reclaim on"]),
        "decode": rows, "ratios": ratios, "long_prefill": {"tokens": ns.long, **long_rows},
    }
    text = json.dumps(result, indent=2)
    print(text)
    print(f"\n| {ns.num_seqs} x {ns.context} | decode ms/step | host ms/step | blocks per seq | KiB per seq "
          f"| pool blocks in use | prefill tok/s |\n|---|---:|---:|---:|---:|---:|---:|")
    for mode in MODES:
        row = rows[mode]
        print(f"| {mode} | {row['decode_ms_per_step']} | {row['host_ms_per_step']} | {row['blocks_per_seq_mean']} | "
              f"{round(row['blocks_per_seq_mean'] * per_block / 1024)} | {row['pool_blocks_in_use']} | "
              f"{row['prefill_tok_s']} |")
    print(f"\n| {ns.long}-token prefill | s | tok/s |\n|---|---:|---:|")
    for name, timing in long_rows.items():
        print(f"| {name} | {timing['seconds']} | {timing['tok_s']} |")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
