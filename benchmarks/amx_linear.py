"""A model step's linears alone: ``cpu_ops.amx_linear`` against oneDNN's prepacked bfloat16 GEMM, side by side.

    python -m benchmarks.amx_linear --rows 8,32,64,128 --rounds 9

The default model's shapes (SmolLM2-135M: per layer q|k|v 576 -> 960, o 576 -> 576, gate|up 576 -> 3072,
down 1536 -> 576; 30 layers; the 576 -> 49152 lm_head), random bfloat16 weights, a distinct weight per layer
as in the model, so each step streams all 269 MB of them from memory as a decode step does (a benchmark that
reuses one layer's weights measures cache hits). ``onednn`` runs ``mkldnn._linear_pointwise`` on oneDNN's
prepacked weights (the engine's path for larger steps), ``amx`` runs ``amx_linear`` on its tile-packed copies.
Time per step (every linear once, in model order), the median of ``--rounds``, the two alternating round by
round; also the weight bytes per second and the largest difference between their outputs. Needs a CPU with
AMX-BF16 (``has_amx_linear()``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.report import alternate
from engine.kernels import cpu_ops

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) per layer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.amx_linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,32,64,128", help="comma-separated step sizes (rows of x)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152, help="lm_head outputs (0: no lm_head)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    ops = cpu_ops()
    if ops is None or not ops.has_amx_linear():
        print("amx_linear: needs the CPU kernels built for a CPU with AMX-BF16", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(ns.layers) for shape in SHAPES] + ([(ns.vocab, 576)] if ns.vocab else [])
    weights = [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    amx = [ops.amx_pack_linear(w) for w in weights]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    del weights
    result: dict[str, object] = {"rows": {}, "layers": ns.layers, "vocab": ns.vocab, "weight_bytes": weight_bytes}
    for rows in (int(r) for r in ns.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in shapes}}
        paths = {
            "onednn": lambda inputs=inputs: [torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")
                                             for (_, k), w in zip(shapes, onednn)],
            "amx": lambda inputs=inputs: [ops.amx_linear(inputs[k], w) for (_, k), w in zip(shapes, amx)],
        }
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(paths["amx"](), paths["onednn"]()))
        times = alternate(paths, ns.rounds)
        med = {name: statistics.median(v) for name, v in times.items()}
        gbps = {name: weight_bytes / ms / 1e6 for name, ms in med.items()}
        result["rows"][str(rows)] = {"median_ms": med, "rounds_ms": times, "weight_gb_per_s": gbps,
                                     "onednn_over_amx": med["onednn"] / med["amx"], "max_abs_diff": diff}
        print(f"{rows:>4} rows: onednn {med['onednn']:.2f} ms ({gbps['onednn']:.1f} GB/s), amx {med['amx']:.2f} ms "
              f"({gbps['amx']:.1f} GB/s): {med['onednn'] / med['amx']:.2f}x; max |amx - onednn| {diff:.4f}",
              flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
