"""Scheduler + input preparation CPU time per step, as a share of step time, at N running sequences.

    python -m benchmarks.step_overhead --num-seqs 128 --input-len 128 --output-len 64

Drives EngineCore directly (no server) so only the engine's own host work is measured: the part of a
step an accelerator cannot hide behind its compute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_overhead", description=__doc__)
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), float16, ...")
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    core = EngineCore(EngineConfig(dtype=ns.dtype, max_num_seqs=ns.num_seqs, kv_cache_memory=2**30,
                                   max_num_batched_tokens=max(2048, ns.num_seqs), num_threads=ns.num_threads,
                                   kv_cache_dtype=ns.kv_cache_dtype))
    sp = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    for i in range(ns.num_seqs):
        core.add_request(str(i), [100 + (i * 7 + j) % 30000 for j in range(ns.input_len)], sp)
    decode_steps = []
    while core.has_unfinished_requests():
        core.step()
        st = core.last_step
        if st is not None and st.num_batched_tokens == ns.num_seqs:  # pure decode steps at full batch
            decode_steps.append(st)
    frac = [s.overhead_fraction for s in decode_steps]
    result = {
        "num_seqs": ns.num_seqs, "decode_steps": len(decode_steps),
        "step_ms_median": 1000 * statistics.median(s.duration_s for s in decode_steps),
        "schedule_ms_median": 1000 * statistics.median(s.schedule_s for s in decode_steps),
        "prepare_ms_median": 1000 * statistics.median(s.prepare_s for s in decode_steps),
        "update_ms_median": 1000 * statistics.median(s.update_s for s in decode_steps),
        "overhead_fraction_median": statistics.median(frac),
        "overhead_fraction_p90": sorted(frac)[int(0.9 * (len(frac) - 1))],
        "command": " ".join(["python -m benchmarks.step_overhead", *(argv if argv is not None else sys.argv[1:])]),
    }
    print(json.dumps(result, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
