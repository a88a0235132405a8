"""W8A8 int8 linears against bfloat16 ones, per shape of the default model, side by side.

    python -m benchmarks.w8a8_gemm --rows 1,32,128,512,2048 --rounds 5

The default model's shapes (SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536; per layer
q|k|v 576 -> 960, o 576 -> 576, gate|up 576 -> 3072, down 1536 -> 576; 30 layers; the 576 -> 49152 lm_head),
random weights, ``--layers`` distinct copies of each projection (a model step's worth, streamed from memory as in
a decode step; one lm_head). Three methods of ``engine.models.layers.linear``, end to end from bfloat16 rows to
bfloat16 rows: ``bf16`` = OneDnnLinearMethod (oneDNN's prepacked bfloat16 GEMM, the engine's path for these
steps without AMX), ``w8a8`` = W8A8LinearMethod (per-token quantization, oneDNN's int8 GEMM, the epilogue: one
native call), ``portable`` = PortableW8A8LinearMethod (the same around ``torch._int_mm``: CPUs without VNNI).
Milliseconds per linear (median of ``--rounds``, the methods alternating round by round); prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from benchmarks.report import alternate, machine_info
from engine.kernels import cpu_ops
from engine.models.layers.linear import (
    Linear,
    LinearMethod,
    OneDnnLinearMethod,
    PortableW8A8LinearMethod,
    W8A8LinearMethod,
)
from engine.models.w8a8 import quantize_weight

SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}  # name: (out, in)


def _paths(ops: object, out: int, inp: int, copies: int, gen: torch.Generator,
           ) -> tuple[list[Linear], dict[str, list[LinearMethod]]]:
    layers, methods = [], {"bf16": [], "w8a8": [], "portable": []}  # type: ignore[var-annotated]
    for _ in range(copies):
        layer = Linear(inp, out, bias=False).bfloat16()
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out, inp, generator=gen) * 0.05)
        int8 = quantize_weight(layer.weight)
        methods["bf16"].append(OneDnnLinearMethod(layer.weight))
        methods["w8a8"].append(W8A8LinearMethod(ops, int8))
        methods["portable"].append(PortableW8A8LinearMethod(ops, int8))
        layers.append(layer)
    return layers, methods


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w8a8_gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32,128,512,2048", help="comma-separated step sizes (rows of x)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    p.add_argument("--layers", type=int, default=30, help="distinct weights per projection (lm_head: 1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    ops = cpu_ops()
    if ops is None or not ops.int8_isa():
        print("w8a8_gemm: needs the CPU kernels and a CPU with VNNI or AMX-INT8", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    rows_list = [int(r) for r in ns.rows.split(",")]
    result: dict[str, object] = {"machine": machine_info(), "int8_isa": ops.int8_isa(),
                                 "threads": torch.get_num_threads(), "ms_per_linear": {}}
    print("| shape | rows | bf16 oneDNN ms | W8A8 ms | portable ms | bf16 / W8A8 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ns.shapes.split(","):
        out, inp = SHAPES[name]
        copies = 1 if name.startswith("lm_head") else ns.layers
        layers, methods = _paths(ops, out, inp, copies, gen)
        for rows in rows_list:
            x = torch.randn(rows, inp, generator=gen).bfloat16()

            def step(ms: list[LinearMethod], x: torch.Tensor = x, ls: list[Linear] = layers) -> Callable[[], object]:
                return lambda: [m.apply(layer, x) for layer, m in zip(ls, ms)]

            paths = {path: step(ms) for path, ms in methods.items()}
            for fn in paths.values():
                fn()  # warm up: oneDNN builds its primitives for the shape
            med = {path: statistics.median(t) / copies for path, t in alternate(paths, ns.rounds).items()}
            result["ms_per_linear"][f"{name} x{rows}"] = med  # type: ignore[index]
            print(f"| {name} | {rows} | {med['bf16']:.3f} | {med['w8a8']:.3f} | {med['portable']:.3f} | "
                  f"{med['bf16'] / med['w8a8']:.2f}x |", flush=True)
        del layers, methods
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
