"""The CPU paged decode attention kernel alone, its AMX path against its AVX-512 loops, side by side.

    python -m benchmarks.decode_attention --seqs 32,128 --seq-len 192 --rounds 7

One KV cache per layer (``--layers``, the default model's shape: 3 kv heads, 9 query heads, head_dim 64,
16-token blocks, bfloat16), allocated like the engine's (huge pages), each sequence's blocks scattered at
random as a long-running cache leaves them. One call per layer reads that layer's cache from memory, as in a
decode step; the time is per call, the median of ``--rounds``, the paths alternating round by round. Needs a
CPU with AMX-BF16 for the ``amx`` path (``has_amx_attention()``); elsewhere only ``vector`` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.attention.backend import kv_cache_shape
from engine.device import CpuDevice
from engine.kernels import cpu_ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="32,128", help="comma-separated numbers of sequences per call")
    p.add_argument("--seq-len", type=int, default=192, help="tokens in the cache per sequence")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--blocks", type=int, default=5825, help="blocks per layer's cache (the default's ~2 GiB)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    ops = cpu_ops()
    if ops is None:
        p.error("the CPU kernels did not build")
    paths = ["vector", "amx"] if ops.has_amx_attention() else ["vector"]
    torch.manual_seed(0)
    shape = kv_cache_shape(ns.blocks, ns.block_size, ns.kv_heads, ns.head_dim)
    caches = [CpuDevice().empty_cache_tensor(shape, torch.bfloat16).normal_() for _ in range(ns.layers)]
    per_seq = (ns.seq_len + ns.block_size - 1) // ns.block_size
    result: dict[str, object] = {"config": vars(ns), "ms_per_call": {}}
    for n in (int(x) for x in ns.seqs.split(",")):
        if n * per_seq > ns.blocks:
            p.error(f"{n} sequences of {ns.seq_len} tokens need more than --blocks {ns.blocks}")
        query = torch.randn(n, ns.kv_heads * ns.group, ns.head_dim).bfloat16()
        tables = torch.randperm(ns.blocks)[:n * per_seq].view(n, per_seq)
        lens = torch.full((n,), ns.seq_len)
        times: dict[str, list[float]] = {path: [] for path in paths}
        for r in range(ns.rounds + 1):  # round 0 warms up
            for path in paths:
                ops.set_amx_attention(path == "amx")
                t = time.perf_counter()
                for cache in caches:
                    ops.paged_decode_attention(query, cache, tables, lens, ns.head_dim ** -0.5)
                if r:
                    times[path].append((time.perf_counter() - t) / ns.layers * 1e3)
        ops.set_amx_attention(True)
        row = {path: statistics.median(t) for path, t in times.items()}
        result["ms_per_call"][str(n)] = {"median": row, "rounds": times}
        mb = 2 * n * ns.seq_len * ns.kv_heads * ns.head_dim * 2 / 1e6
        print(f"{n:4d} sequences ({mb:.1f} MB of keys and values per call): "
              + ", ".join(f"{path} {ms:.3f} ms" for path, ms in row.items())
              + (f" ({row['vector'] / row['amx']:.2f}x)" if "amx" in row else ""), flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
