"""Decode time per token with multi-step decode (``--num-scheduler-steps``) against single-step, in process.

    python -m benchmarks.multi_step --num-seqs 32 --steps 1 8 --input-len 64 --output-len 64

Drives EngineCore directly (no server) on the default model (or --model): --num-seqs requests of --input-len
random tokens, greedy, each for --output-len tokens. After the prefills, the decode phase's wall time is divided
by the tokens each sequence got: the time of one decode pass of the whole batch ("ms per token"), and of it the
host's share outside the forward passes (scheduling, input preparation, sampling bookkeeping, stop checks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def measure(ns: argparse.Namespace, steps: int) -> dict[str, float]:
    core = EngineCore(EngineConfig(model=ns.model, dtype=ns.dtype, max_num_seqs=ns.num_seqs, kv_cache_memory=2**30,
                                   num_threads=ns.num_threads, num_scheduler_steps=steps, disable_log_stats=True),
                      show_progress=False)
    executor = core.executor
    forward_s = 0.0
    execute = executor.execute_model

    def timed(out):  # type: ignore[no-untyped-def]
        nonlocal forward_s
        t0 = time.perf_counter()
        try:
            return execute(out)
        finally:
            forward_s += time.perf_counter() - t0 - executor.last_prepare_s

    executor.execute_model = timed  # type: ignore[method-assign]
    sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    runs = []
    for rep in range(ns.repeats):
        for i in range(ns.num_seqs):
            prompt = [(i * 7 + j * 13) % min(5000, core.vocab_size) for j in range(ns.input_len)]
            core.add_request(f"{rep}-{i}", prompt, sp)
        while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
            core.step()   # the prefills (and their first tokens)
        forward_s = 0.0
        t0 = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
        wall = time.perf_counter() - t0
        tokens = ns.output_len - 1   # per sequence, after the prefill's
        runs.append((1000 * wall / tokens, 1000 * (wall - forward_s) / tokens))
    return {"num_scheduler_steps": steps,
            "ms_per_token_median": statistics.median(r[0] for r in runs),
            "host_ms_per_token_median": statistics.median(r[1] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multi_step", description=__doc__)
    p.add_argument("--model", default=None, help="a checkpoint folder or GGUF (default: the default model)")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 8], help="--num-scheduler-steps values to compare")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    result = {"num_seqs": ns.num_seqs, "input_len": ns.input_len, "output_len": ns.output_len,
              "runs": [measure(ns, steps) for steps in ns.steps]}
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
