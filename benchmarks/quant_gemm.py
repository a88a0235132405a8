"""The ``quant_linear`` kernel against oneDNN's float32 GEMM on the dequantized weights, per projection shape
of the default model (SmolLM2-135M: hidden 576, intermediate 1536, vocab 49152), at several row counts.

    python -m benchmarks.quant_gemm --rows 1,8,9,16,32,48,128,512

Random Q4_1 blocks (what the default GGUF holds), weights hot in cache after two warm-up calls: the kernels'
arithmetic, not the memory traffic of a whole model (benchmarks/step_overhead.py measures steps). Prints the
median time of each and GFLOP/s; both run in the same process, back to back.

    python -m benchmarks.quant_gemm --rows 9,14,32,128 --against HEAD~1

compares the working tree's kernel with the one at a git revision instead of oneDNN: that revision's
``engine/kernels/*.cpp`` are built as a second extension (``-O3 -march=native``, as the engine builds them)
and the two run alternately, ``--rounds`` times, in this process; the ratio is old time / new time.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.kernels import cpu_ops
from engine.models.layers.linear import onednn_linear, onednn_pack
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


ROOT = Path(__file__).resolve().parent.parent
KERNEL_SOURCES = ("cpu_ops.cpp", "quant_linear.cpp")


def build_at_revision(rev: str) -> Any:
    """The CPU kernels as they were at git revision ``rev``, built as their own extension module."""
    from torch.utils.cpp_extension import load

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    src = Path(tempfile.mkdtemp(prefix=f"sluice-kernels-{commit[:10]}-"))
    texts = []
    for name in KERNEL_SOURCES:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:engine/kernels/{name}"], check=True,
                              capture_output=True, text=True).stdout
        (src / name).write_text(text)
        texts.append(text)
    digest = hashlib.sha256("".join(texts).encode()).hexdigest()[:10]
    return load(name=f"sluice_cpu_ops_rev_{digest}", sources=[str(src / n) for n in KERNEL_SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def _random_layers(gen: torch.Generator) -> Iterator[tuple[str, int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each projection shape as random Q4_1 blocks: (name, k, n, codes, scales, mins)."""
    for name, k, n in SHAPES:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
        mins = (-torch.rand(n, k // 32, generator=gen) * 0.05).half()
        yield name, k, n, codes, scales, mins


def _compare(ns: argparse.Namespace, ops: Any) -> list[dict[str, Any]]:
    old = build_at_revision(ns.against)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, k, n, codes, scales, mins in _random_layers(gen):
        for rows in (int(r) for r in ns.rows.split(",")):
            x = torch.randn(rows, k, generator=gen)
            diff = (ops.quant_linear(x, codes, scales, mins, "u4") - old.quant_linear(x, codes, scales, mins, "u4"))
            reps = max(3, ns.reps // 4) if name == "lm_head" else ns.reps
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(ns.rounds):  # alternate, so drift in the machine's speed hits both alike
                for key, mod in (("old", old), ("new", ops)):
                    run = functools.partial(mod.quant_linear, x, codes, scales, mins, "u4")
                    times[key].append(_median_s(run, reps))
            t_old, t_new = (sorted(v)[len(v) // 2] for v in (times["old"], times["new"]))
            results.append({"shape": name, "k": k, "n": n, "rows": rows, "against": ns.against,
                            "old_ms": 1e3 * t_old, "new_ms": 1e3 * t_new, "speedup": t_old / t_new,
                            "max_abs_diff": float(diff.abs().max())})
            print(f"{name:8s} rows={rows:4d}  {ns.against} {1e3 * t_old:8.3f} ms | working tree {1e3 * t_new:8.3f} ms"
                  f" | {t_old / t_new:.3f}x  (max |diff| {results[-1]['max_abs_diff']:.1e})", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,9,16,32,48,128,512", help="comma-separated row counts")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--against", default=None, metavar="REV",
                   help="compare with the kernel at this git revision instead of oneDNN")
    p.add_argument("--rounds", type=int, default=7, help="with --against: alternating rounds per shape")
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    ops = cpu_ops()
    if ops is None:
        p.error("the CPU kernels are unavailable (SLUICE_CPU_KERNELS=0, or no compiler)")
    if ns.against:
        _write(ns.out, _compare(ns, ops))
        return 0
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, k, n, codes, scales, mins in _random_layers(gen):
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
    _write(ns.out, results)
    return 0


def _write(path: str | None, results: list[dict[str, Any]]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
