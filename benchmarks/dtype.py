"""In-process prefill time and output throughput of the engine in each ``--dtype``, side by side.

    python -m benchmarks.dtype --dtypes float32,bfloat16 --prompts 32 --input-len 128 --output-len 128 --rounds 3

For each round and each dtype (alternating, so drift on a shared machine hits both alike): the time to
prefill ``--prompts`` fresh prompts (``max_tokens`` 1) and the output tokens/s of a full greedy run of
``--output-len`` tokens each (``ignore_eos``) through ``engine.LLM``. Every run gets prompts no earlier
run saw, so the prefix cache never serves one from another. Ratios are per round against the first dtype.

A dtype written ``bfloat16:no-amx`` runs with the AMX decode attention turned off (the AVX-512 loops), so

    python -m benchmarks.dtype --dtypes bfloat16:no-amx,bfloat16 --prompts 128

measures that kernel path alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from engine import LLM, SamplingParams
from engine.kernels import cpu_ops

NO_AMX = ":no-amx"


def _amx_attention(on: bool) -> None:
    ops = cpu_ops()
    if ops is not None:
        ops.set_amx_attention(on)


def _prompts(rng: random.Random, count: int, length: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(count)]


def measure(llm: LLM, rng: random.Random, prompts: int, input_len: int, output_len: int) -> dict[str, float]:
    """One prefill-only run and one full run on fresh prompts: seconds and output tokens/s."""
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(_prompts(rng, prompts, input_len), first)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(_prompts(rng, prompts, input_len), full)
    full_s = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prefill_s": prefill_s, "full_s": full_s, "output_tokens": tokens, "tok_per_s": tokens / full_s}


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Medians per dtype and, per round, each dtype's ratio to the first one (>1: faster)."""
    names = list(runs)
    base = runs[names[0]]
    out: dict[str, Any] = {"median": {}, "ratios": {}}
    for name, rows in runs.items():
        out["median"][name] = {key: statistics.median(r[key] for r in rows)
                               for key in ("prefill_s", "full_s", "tok_per_s")}
        out["ratios"][name] = {
            "prefill_speedup": [b["prefill_s"] / r["prefill_s"] for b, r in zip(base, rows, strict=True)],
            "throughput": [r["tok_per_s"] / b["tok_per_s"] for b, r in zip(base, rows, strict=True)],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dtype", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated --dtype values; the first is the base")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    dtypes = [d.strip() for d in ns.dtypes.split(",") if d.strip()]
    rng = random.Random(ns.seed)
    if any(d.endswith(NO_AMX) for d in dtypes) and not getattr(cpu_ops(), "has_amx_attention", lambda: False)():
        p.error(f"{NO_AMX}: this CPU or build has no AMX decode attention to turn off")
    engines = {d: LLM(dtype=d.removesuffix(NO_AMX), kv_cache_memory=2**30) for d in dtypes}
    for d, llm in engines.items():  # warm-up: kernels built, buffers allocated
        _amx_attention(not d.endswith(NO_AMX))
        measure(llm, rng, 2, ns.input_len, 4)
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in dtypes}
    for r in range(ns.rounds):
        for d in dtypes:
            _amx_attention(not d.endswith(NO_AMX))
            row = measure(engines[d], rng, ns.prompts, ns.input_len, ns.output_len)
            runs[d].append(row)
            print(f"round {r + 1} {d:>9}: prefill {row['prefill_s']:.3f} s, {row['tok_per_s']:.1f} out tok/s",
                  flush=True)
    result = {"config": vars(ns), "runs": runs, "summary": summarize(runs)}
    for d, m in result["summary"]["median"].items():
        ratios = result["summary"]["ratios"][d]
        print(f"{d:>9}: median prefill {m['prefill_s']:.3f} s "
              f"({', '.join(f'{x:.2f}x' for x in ratios['prefill_speedup'])}), "
              f"{m['tok_per_s']:.1f} tok/s ({', '.join(f'{x:.2f}x' for x in ratios['throughput'])})")
    _amx_attention(True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
