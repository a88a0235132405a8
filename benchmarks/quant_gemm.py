"""The ``quant_linear`` kernel against oneDNN's float32 GEMM on the dequantized weights, per projection shape
of the default model (SmolLM2-135M: hidden 576, intermediate 1536, vocab 49152), at several row counts.

    python -m benchmarks.quant_gemm --rows 1,8,9,16,32,48,128,512

Random Q4_1 blocks (what the default GGUF holds), weights hot in cache after two warm-up calls: the kernels'
arithmetic, not the memory traffic of a whole model (benchmarks/step_overhead.py measures steps). Prints the
median time of each and GFLOP/s; both run in the same process, back to back.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from engine.kernels import cpu_ops
from engine.models.llama import onednn_linear, onednn_pack
from engine.models.quant import QuantWeight

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,9,16,32,48,128,512", help="comma-separated row counts")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    ops = cpu_ops()
    if ops is None:
        p.error("the CPU kernels are unavailable (SLUICE_CPU_KERNELS=0, or no compiler)")
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, k, n in SHAPES:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
        mins = (-torch.rand(n, k // 32, generator=gen) * 0.05).half()
        packed = onednn_pack(QuantWeight("u4", codes, scales, mins).dequantize())
        for rows in (int(r) for r in ns.rows.split(",")):
            x = torch.randn(rows, k, generator=gen)
            reps = max(3, ns.reps // 4) if name == "lm_head" else ns.reps
            tq = _median_s(lambda: ops.quant_linear(x, codes, scales, mins, "u4"), reps)  # noqa: B023
            to = _median_s(lambda: onednn_linear(x, packed), reps)  # noqa: B023
            flop = 2 * rows * k * n
            results.append({"shape": name, "k": k, "n": n, "rows": rows, "quant_ms": 1e3 * tq, "onednn_ms": 1e3 * to,
                            "quant_gflops": flop / tq / 1e9, "onednn_gflops": flop / to / 1e9, "speedup": to / tq})
            r = results[-1]
            print(f"{name:8s} rows={rows:4d}  quant {r['quant_ms']:8.3f} ms {r['quant_gflops']:6.1f} GF/s | "
                  f"oneDNN {r['onednn_ms']:8.3f} ms {r['onednn_gflops']:6.1f} GF/s | {r['speedup']:.2f}x", flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
