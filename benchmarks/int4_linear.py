"""Weight-only 4-bit linears (GPTQ / AWQ / compressed-tensors W4A16 layers) against bfloat16 ones, at a decode
(1 row) and a prefill (512 rows) step, beside the memory roofline.

    python -m benchmarks.int4_linear --rows 1,512 --shape 2048x8192 --copies 8 --rounds 7

``--copies`` distinct random weights of one [out, in] shape (``--shape in x out``), run one after the other, so
that every product streams its weight from memory as a decode step does (one copy would sit in the cache). Methods,
end to end from bfloat16 rows to bfloat16 rows: ``bf16`` = OneDnnLinearMethod (the engine's bfloat16 path),
``int4`` = Int4PackLinearMethod held to PyTorch's int4 CPU kernel at every row count (groups of ``--group``),
``int4-gemv`` = the same with our ``int4_gemv`` up to ``GEMV_MAX_ROWS`` rows (torch's kernel above),
``int4-dense`` = the same held to its prefill path (the packed weight dequantized tile by tile into the bfloat16
GEMM), ``int4-dequant`` = Int4DequantLinearMethod (the fallback). The engine's Int4PackLinearMethod runs ``int4``
below ``DENSE_MIN_ROWS`` rows and ``int4-dense`` from there on. Milliseconds per linear (median of ``--rounds``,
the methods alternating round by round); the roofline is the bytes of one weight (codes, scales and offsets as the
method holds them) over the read bandwidth of a 1 GiB bfloat16 sum measured in the same run. Prints a markdown
table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.report import machine_info
from engine.kernels import avx2_int4_ops, cpu_ops
from engine.models.int4 import Int4Weight
from engine.models.layers.int4_linear import Int4DequantLinearMethod, Int4PackLinearMethod
from engine.models.layers.linear import Linear, LinearMethod, OneDnnLinearMethod


def read_bandwidth() -> float:
    """Bytes per second of a sum over 1 GiB of bfloat16 (median of 3)."""
    x = torch.ones(2**29, dtype=torch.bfloat16)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 2 / statistics.median(times)


def _methods(inp: int, out: int, group: int, copies: int, dequant: bool, avx2: bool = False
             ) -> tuple[Linear, dict[str, list[LinearMethod]], dict[str, int]]:
    gen = torch.Generator().manual_seed(0)
    ops = cpu_ops()
    names = ["bf16", "int4"] + (["int4-gemv"] if ops is not None else []) + ["int4-dense"]
    # The build an AVX2 CPU without AVX-512 runs: the portable loops as the compiler vectorizes them for it.
    others = {"int4-gemv-avx2": avx2_int4_ops()} if avx2 else {}
    names += list(others)
    names += ["int4-dequant"] if dequant else []
    methods: dict[str, list[LinearMethod]] = {n: [] for n in names}
    for _ in range(copies):
        weight = Int4Weight(torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8),
                            torch.rand(out, inp // group, generator=gen) * 0.01,
                            torch.full((out, inp // group), 8.0), group, dtype=torch.bfloat16)
        methods["bf16"].append(OneDnnLinearMethod(weight.dequantize().bfloat16()))
        methods["int4"].append(Int4PackLinearMethod(weight, group, dense_min_rows=None))
        if ops is not None:
            methods["int4-gemv"].append(Int4PackLinearMethod(weight, group, dense_min_rows=None, ops=ops))
        methods["int4-dense"].append(Int4PackLinearMethod(weight, group, dense_min_rows=1))
        for name, build in others.items():
            methods[name].append(Int4PackLinearMethod(weight, group, dense_min_rows=None, ops=build))
        if dequant:
            methods["int4-dequant"].append(Int4DequantLinearMethod(weight))
    first = methods["int4"][0]
    assert isinstance(first, Int4PackLinearMethod)
    nbytes = {"bf16": out * inp * 2,
              "int4": first.packed.numel() * first.packed.element_size() + first.scale_and_zero.numel() * 2,
              "int4-gemv": first.packed.numel() * first.packed.element_size() + first.scale_and_zero.numel() * 2,
              "int4-dense": first.packed.numel() * first.packed.element_size() + first.scale_and_zero.numel() * 2,
              "int4-dequant": out * inp + 2 * 4 * out * (inp // group)}
    nbytes |= {name: nbytes["int4-gemv"] for name in others}
    return Linear(inp, out, bias=False), methods, nbytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int4_linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,512", help="comma-separated step sizes (rows of x)")
    p.add_argument("--shape", default="2048x8192", help="in x out features")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dequant", action="store_true", help="also time the dequantize-per-call fallback")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--avx2", action="store_true", help="also time int4_gemv as built for an AVX2 CPU without "
                   "AVX-512 (int4-gemv-avx2: its portable loops vectorized for x86-64-v3)")
    ns = p.parse_args(argv)
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    inp, out = (int(v) for v in ns.shape.split("x"))
    layer, methods, nbytes = _methods(inp, out, ns.group, ns.copies, ns.dequant, ns.avx2)
    layer.requires_grad_(False)
    bandwidth = read_bandwidth()
    print(f"# {machine_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# {inp} -> {out}, groups of {ns.group}, {ns.copies} copies; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| rows | method | ms per linear | roofline ms | x roofline | vs bf16 |")
    print("|---:|---|---:|---:|---:|---:|")
    for rows in (int(r) for r in ns.rows.split(",")):
        x = torch.randn(rows, inp).bfloat16()
        times: dict[str, list[float]] = {n: [] for n in methods}
        with torch.inference_mode():
            for rnd in range(ns.rounds + 1):
                for name, copies in methods.items():
                    t0 = time.perf_counter()
                    for method in copies:
                        method.apply(layer, x)
                    if rnd:   # the first round warms the kernels and the allocator
                        times[name].append((time.perf_counter() - t0) / ns.copies * 1e3)
        med = {n: statistics.median(t) for n, t in times.items()}
        for name, ms in med.items():
            roof = nbytes[name] / bandwidth * 1e3
            print(f"| {rows} | {name} | {ms:.3f} | {roof:.3f} | {ms / roof:.2f} | {med['bf16'] / ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
