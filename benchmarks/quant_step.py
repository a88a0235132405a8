"""In-process step time of the engine under each ``--quantization``, side by side: decode steps at 1, 32 and 128
running sequences, and the prefill of the same prompts.

    python -m benchmarks.quant_step --quantizations none,w8a8 --num-seqs 1,32,128 --rounds 3

One ``EngineCore`` per quantization is loaded once; then, round after round and quantization after quantization
(interleaved, so drift on a shared machine falls on all alike), each runs ``--num-seqs`` fresh prompts of
``--input-len`` tokens for ``--output-len`` greedy tokens (``ignore_eos``). A decode step is one whose batch is
every sequence with one token each; its median wall time is the figure. Prefill is the time of the steps before
the first pure decode step. Ratios are per round against the first quantization.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def run_once(core: EngineCore, num_seqs: int, input_len: int, output_len: int, salt: int) -> dict[str, float]:
    """Decode-step median (ms) and prefill time (ms) of one batch of fresh prompts."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_seqs):
        # distinct prompts per call: no prefix-cache hit from an earlier run
        core.add_request(f"{salt}-{i}", [100 + (salt * 7919 + i * 131 + j * 17) % 30000 for j in range(input_len)], sp)
    decode: list[float] = []
    prefill_s = 0.0
    while core.has_unfinished_requests():
        core.step()
        st = core.last_step
        if st is None:
            continue
        if st.num_batched_tokens == num_seqs:  # every sequence with one token: a decode step
            decode.append(st.duration_s)
        elif not decode:
            prefill_s += st.duration_s
    return {"decode_step_ms": 1000 * statistics.median(decode) if decode else float("nan"),
            "prefill_ms": 1000 * prefill_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_step", description=__doc__)
    p.add_argument("--model", default=None, help="default: the default model (GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantizations", default="none,w8a8", help="comma-separated; 'none' = the checkpoint as it is")
    p.add_argument("--num-seqs", default="1,32,128")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    quants = [q.strip() for q in ns.quantizations.split(",") if q.strip()]
    sizes = [int(n) for n in ns.num_seqs.split(",")]
    cores = {q: EngineCore(EngineConfig(model=ns.model, dtype=ns.dtype, quantization=None if q == "none" else q,
                                        max_num_seqs=max(sizes), max_num_batched_tokens=max(2048, max(sizes)),
                                        kv_cache_memory=2**30, num_threads=ns.num_threads, disable_log_stats=True))
             for q in quants}
    rows: list[dict[str, Any]] = []
    salt = 0
    for r in range(ns.rounds):
        for n in sizes:
            for q in quants:
                salt += 1
                rows.append({"round": r, "num_seqs": n, "quantization": q,
                             **run_once(cores[q], n, ns.input_len, ns.output_len, salt)})
    summary = []
    for n in sizes:
        base = statistics.median(x["decode_step_ms"] for x in rows
                                 if x["num_seqs"] == n and x["quantization"] == quants[0])
        for q in quants:
            mine = [x for x in rows if x["num_seqs"] == n and x["quantization"] == q]
            step = statistics.median(x["decode_step_ms"] for x in mine)
            summary.append({"num_seqs": n, "quantization": q, "decode_step_ms": round(step, 2),
                            "prefill_ms": round(statistics.median(x["prefill_ms"] for x in mine), 1),
                            "vs_first": round(base / step, 3)})
    print("| sequences | quantization | decode step (ms) | speed-up | prefill (ms) |")
    print("|---:|---|---:|---:|---:|")
    for s in summary:
        print(f"| {s['num_seqs']} | {s['quantization']} | {s['decode_step_ms']} | {s['vs_first']}× "
              f"| {s['prefill_ms']} |")
    result = {"command": " ".join(["python -m benchmarks.quant_step", *(argv if argv is not None else sys.argv[1:])]),
              "summary": summary, "rows": rows}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
