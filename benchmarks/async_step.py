"""In-process decode step time with async scheduling on and off, side by side, and the host time it hides.

    python -m benchmarks.async_step --num-seqs 32,128 --rounds 3

Two ``EngineCore``s (async scheduling off, on) of the same model are loaded once; round after round (interleaved,
so drift on a shared machine falls on both), each runs ``--num-seqs`` fresh prompts of ``--input-len`` tokens for
``--output-len`` greedy tokens (``ignore_eos``). The decode step time is the wall time from the moment every
sequence has its first token to the end, over the ``output_len - 1`` decode steps in it (a step's own duration means
different things in the two modes). The host time per decode step (schedule + prepare + update, from the sync
engine's ``StepStats``) is what async scheduling can hide.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def run_once(core: EngineCore, num_seqs: int, input_len: int, output_len: int, salt: int) -> dict[str, float]:
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_seqs):   # distinct prompts per call: no prefix-cache hit from an earlier run
        core.add_request(f"{salt}-{i}", [100 + (salt * 7919 + i * 131 + j * 17) % 30000 for j in range(input_len)], sp)
    started: set[str] = set()
    t_decode = None
    host: list[float] = []
    while core.has_unfinished_requests():
        outputs = core.step()
        started.update(o.request_id for o in outputs if o.new_token_ids)
        if t_decode is None:
            if len(started) == num_seqs:
                t_decode = time.perf_counter()
            continue
        st = core.last_step
        if st is not None and st.num_batched_tokens == num_seqs:
            host.append(st.schedule_s + st.prepare_s + st.update_s)
    assert t_decode is not None
    return {"decode_step_ms": 1000 * (time.perf_counter() - t_decode) / (output_len - 1),
            "host_ms": 1000 * statistics.median(host) if host else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.async_step", description=__doc__)
    p.add_argument("--model", default=None, help="default: the default model (GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-seqs", default="32,128")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    sizes = [int(n) for n in ns.num_seqs.split(",")]
    cores = {mode: EngineCore(EngineConfig(model=ns.model, dtype=ns.dtype, async_scheduling=mode == "on",
                                           max_num_seqs=max(sizes), max_num_batched_tokens=max(2048, max(sizes)),
                                           kv_cache_memory=2**30, num_threads=ns.num_threads,
                                           disable_log_stats=True))
             for mode in ("off", "on")}
    rows: list[dict[str, Any]] = []
    salt = 0
    for r in range(ns.rounds):
        for n in sizes:
            for mode, core in cores.items():
                salt += 1
                rows.append({"round": r, "num_seqs": n, "async": mode,
                             **run_once(core, n, ns.input_len, ns.output_len, salt)})
    summary = []
    for n in sizes:
        off = [x for x in rows if x["num_seqs"] == n and x["async"] == "off"]
        on = [x for x in rows if x["num_seqs"] == n and x["async"] == "on"]
        off_ms = statistics.median(x["decode_step_ms"] for x in off)
        on_ms = statistics.median(x["decode_step_ms"] for x in on)
        summary.append({"num_seqs": n, "off_step_ms": round(off_ms, 2), "on_step_ms": round(on_ms, 2),
                        "on_over_off": round(on_ms / off_ms, 3),
                        "sync_host_ms": round(statistics.median(x["host_ms"] for x in off), 2),
                        "saved_ms": round(off_ms - on_ms, 2)})
    for core in cores.values():
        core.close()
    result = {"config": vars(ns), "rows": rows, "summary": summary}
    text = json.dumps(result, indent=1)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
