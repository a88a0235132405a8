"""Expert parallel against tensor parallel over two real processes on one host: the decode step of the
``benchmarks.moe_step`` mixture-of-experts model, and the all-reduce alone.

    python -m benchmarks.moe_parallel --num-seqs 1,32,128 --layers 2 --repeats 7

Writes the random Qwen3-MoE-shaped checkpoint of ``benchmarks.moe_step`` once, then starts two ranks (one thread
each: the two cores of this machine are then one per rank), each joining a gloo group
(``engine.distributed.init_parallel``) and loading its shard twice: TP 2 (every expert's intermediate size
sliced) and TP 2 with expert parallel (each rank holds half the experts, whole), both prepared with the CPU
device's kernel choice. Round after round, size after size, the ranks run a decode step of each (the same steps
as ``benchmarks.moe_step``: forward and logits), then an all-reduce of a [N, hidden] tensor alone (the layer's
communication: one such all-reduce after attention and one after the MoE block per layer). Medians of rank 0.
"""
# ruff: noqa: E402  (the engine's process settings come before torch's import)
from __future__ import annotations

from engine.entrypoints.process import set_openmp_defaults, use_huge_pages

set_openmp_defaults()
use_huge_pages()

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3MoeForCausalLM

from benchmarks.moe_step import SluiceDecode, hf_configs, write_random
from engine.device import CpuDevice
from engine.distributed import ParallelContext, init_parallel
from engine.models import load_model
from engine.models.dtype import resolve_dtype
from engine.worker.worker import prepare_model


def _rank(rank: int, port: int, path: str, ns: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    parallel = init_parallel(rank, 2, 1, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=120)
    try:
        results.put((rank, _measure(parallel, path, ns)))
    finally:
        torch.distributed.destroy_process_group()


def _measure(parallel: ParallelContext, path: str, ns: argparse.Namespace) -> dict[str, Any]:
    dtype = resolve_dtype(ns.dtype)
    device = CpuDevice(num_threads=1)
    backend = device.attention_backend()
    models = {}
    for name, ep in (("tp2", False), ("tp2_ep", True)):
        models[name] = load_model(path, dtype, parallel=replace(parallel, expert_parallel=ep))
        prepare_model(models[name], device, dtype)
    sizes = [int(n) for n in ns.num_seqs.split(",")]
    steps = {(name, n): SluiceDecode(m, backend, device, dtype, n, ns.context).step
             for n in sizes for name, m in models.items()}
    hidden = models["tp2"].config.hidden_size
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for rep in range(ns.repeats + 1):
            for n in sizes:
                for name in models:
                    torch.distributed.barrier()
                    t0 = time.perf_counter()
                    steps[name, n]()
                    if rep:
                        times.setdefault(f"{name}/{n}", []).append(time.perf_counter() - t0)
                x = torch.randn(n, hidden).to(dtype)
                torch.distributed.barrier()
                t0 = time.perf_counter()
                for _ in range(10):
                    parallel.all_reduce(x)
                if rep:
                    times.setdefault(f"all_reduce/{n}", []).append((time.perf_counter() - t0) / 10)
    return {key: 1000 * statistics.median(v) for key, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", default="1,32,128")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=7)
    ns = p.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    moe_cfg, _ = hf_configs(ns)
    write_random(Qwen3MoeForCausalLM, moe_cfg, Path(tmp.name), resolve_dtype(ns.dtype))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, tmp.name, ns, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    tmp.cleanup()
    rank0 = out[0]
    rows = []
    for n in [int(n) for n in ns.num_seqs.split(",")]:
        tp, ep, ar = rank0[f"tp2/{n}"], rank0[f"tp2_ep/{n}"], rank0[f"all_reduce/{n}"]
        # two all-reduces per layer (after attention, after the MoE block) and the logits' all-gather
        rows.append({"num_seqs": n, "tp2_ms": round(tp, 2), "tp2_ep_ms": round(ep, 2),
                     "ep_over_tp": round(ep / tp, 2), "all_reduce_ms": round(ar, 3),
                     "all_reduce_per_step_ms": round(2 * ns.layers * ar, 2)})
    result = {"command": " ".join(["python -m benchmarks.moe_parallel", *(argv if argv is not None else sys.argv[1:])]),
              "layers": ns.layers, "threads_per_rank": 1, "decode": rows}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
