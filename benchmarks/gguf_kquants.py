"""A GGUF Q4_K projection on the int4 kernel against the same weights dequantized to bfloat16 (what a Q5_K or Q6_K
projection runs on), at a decode step (1 row) and a small batch, with the memory each method holds.

    python -m benchmarks.gguf_kquants --rows 1,32 --shape 2048x8192 --copies 8 --rounds 7

``--copies`` distinct random Q4_K matrices of one shape (``--shape in x out``), run one after the other, so that
every product streams its weight from memory as a decode step does. Methods, from bfloat16 rows to bfloat16 rows:
``q4_k-int4`` = Int4PackLinearMethod on ``gguf_kquants.q4_k_weight`` (what the GGUF loader gives a Q4_K
projection), ``bf16`` = OneDnnLinearMethod on the dequantized weight (a Q5_K / Q6_K projection, or any K-quant
loaded as transformers loads it), ``q5_k-2planes`` = the exact two-plane form a Q5_K matrix could take on the same
kernel, not wired (``w = [d sc q_low - dmin m] + [16 d sc q_high]``: one int4 weight of twice the columns, the
input read twice). ``held MiB``: what the method keeps for one matrix after a bfloat16 step (the int4 kernel's
packed codes and its scale-and-offset table, in the model's dtype only); ``file MiB``: the Q4_K bytes. The roofline
is the bytes the method reads per product over the read bandwidth of a 1 GiB bfloat16 sum in the same run. Prints a
markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from benchmarks.int4_linear import read_bandwidth
from benchmarks.report import machine_info
from engine.models.gguf_kquants import q4_k_weight
from engine.models.layers.int4_linear import Int4PackLinearMethod
from engine.models.layers.linear import Linear, LinearMethod, OneDnnLinearMethod

_Q4_K_BYTES = 144


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Q4_K bytes [rows, cols / 256 * 144] with random codes, scales and minimums and float16 headers of ~0.01."""
    raw = rng.integers(0, 256, (rows, cols // 256, _Q4_K_BYTES), dtype=np.uint8)
    raw[..., 0:4] = rng.uniform(0, 0.01, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


class _TwoPlanes(LinearMethod):
    """An int4 method over [x | x] (the low-nibble and high-bit planes side by side)."""

    def __init__(self, method: Int4PackLinearMethod) -> None:
        self.method = method

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(layer, torch.cat([x, x], dim=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_kquants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32", help="comma-separated step sizes (rows of x)")
    p.add_argument("--shape", default="2048x8192", help="in x out features")
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ns = p.parse_args(argv)
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    inp, out = (int(v) for v in ns.shape.split("x"))
    rng = np.random.default_rng(0)
    methods: dict[str, list[LinearMethod]] = {"bf16": [], "q4_k-int4": [], "q5_k-2planes": []}
    for _ in range(ns.copies):
        weight = replace(q4_k_weight(random_q4_k(out, inp, rng)), dtype=torch.bfloat16)   # as a bf16 model loads it
        methods["bf16"].append(OneDnnLinearMethod(weight.dequantize().bfloat16()))
        methods["q4_k-int4"].append(Int4PackLinearMethod(weight, 32))
        planes = replace(q4_k_weight(random_q4_k(out, 2 * inp, rng)), dtype=torch.bfloat16)
        methods["q5_k-2planes"].append(_TwoPlanes(Int4PackLinearMethod(planes, 32)))
    layer = Linear(inp, out, bias=False).requires_grad_(False)
    first = methods["q4_k-int4"][0]
    assert isinstance(first, Int4PackLinearMethod)
    first.apply(layer, torch.zeros(1, inp, dtype=torch.bfloat16))   # a bfloat16 step: nothing more is made
    table = first.scale_and_zero.numel()
    read = {"bf16": out * inp * 2, "q4_k-int4": first.packed.numel() * first.packed.element_size() + table * 2}
    read["q5_k-2planes"] = 2 * read["q4_k-int4"]
    kept = first.packed.numel() + sum(t.numel() * t.element_size() for t in first._by_dtype.values())
    held = {"bf16": read["bf16"], "q4_k-int4": kept, "q5_k-2planes": 2 * kept}
    file_mib = out * inp // 256 * _Q4_K_BYTES / 2**20
    bandwidth = read_bandwidth()
    print(f"# {machine_info()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# {inp} -> {out}, {ns.copies} copies; Q4_K file {file_mib:.1f} MiB; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| rows | method | held MiB | ms per linear | roofline ms | x roofline | vs bf16 |")
    print("|---:|---|---:|---:|---:|---:|---:|")
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
            roof = read[name] / bandwidth * 1e3
            print(f"| {rows} | {name} | {held[name] / 2**20:.1f} | {ms:.3f} | {roof:.3f} | {ms / roof:.2f} | "
                  f"{med['bf16'] / ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
