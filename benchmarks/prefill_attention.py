"""Prefill attention alone: the prefill kernels over the paged cache against SDPA on the same keys, side by side.

    python -m benchmarks.prefill_attention --shapes 16x128,4x512,1x2048,1x4096 --rounds 7

For each shape ``NxL`` (N fresh prompts of L tokens), bfloat16 queries and a bfloat16 paged cache of the
default model's shape (9 query heads, 3 kv heads, head_dim 64, 16-token blocks, blocks scattered at random):
``sdpa`` is ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on the prompts' keys and
values as contiguous tensors (what the engine's SDPA paths call for fresh prompts), ``amx`` is
``cpu_ops.paged_prefill_attention`` reading them from the cache (CPUs with AMX-BF16, ``has_amx_attention()``),
``bf16`` is ``cpu_ops.bf16_prefill_attention`` (CPUs with AVX512-BF16, ``has_bf16_attention()``). Time per layer
call, the median of ``--rounds``, the paths alternating round by round; the largest difference between each
kernel's output and SDPA's is reported too. Needs a CPU with one of the kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.report import alternate
from engine.attention.backend import kv_cache_shape
from engine.kernels import cpu_ops


def _shape(text: str) -> tuple[int, int]:
    n, _, length = text.lower().partition("x")
    return int(n), int(length)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16x128,4x512,1x2048,1x4096", help="comma-separated NxL: N prompts of L tokens")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    ops = cpu_ops()
    kernels = {}
    if ops is not None and ops.has_amx_attention():
        kernels["amx"] = ops.paged_prefill_attention
    if ops is not None and ops.has_bf16_attention():
        kernels["bf16"] = ops.bf16_prefill_attention
    if not kernels:
        print("prefill_attention: needs the CPU kernels built for a CPU with AMX-BF16 or AVX512-BF16", file=sys.stderr)
        return 2
    hkv, d, bs = ns.kv_heads, ns.head_dim, ns.block_size
    hq = hkv * ns.group
    gen = torch.Generator().manual_seed(0)
    result: dict[str, object] = {"shapes": {}, "kv_heads": hkv, "query_heads": hq, "head_dim": d, "block_size": bs}
    for text in ns.shapes.split(","):
        n, length = _shape(text)
        per_seq = -(-length // bs)
        blocks = n * per_seq + 8
        cache = torch.randn(kv_cache_shape(blocks, bs, hkv, d), generator=gen).bfloat16()
        tables = torch.randperm(blocks, generator=gen)[:n * per_seq].view(n, per_seq)
        query = torch.randn(n * length, hq, d, generator=gen).bfloat16()
        starts = torch.arange(n + 1) * length
        lens = torch.full((n,), length)
        keys = cache[0][tables].reshape(n, per_seq * bs, hkv, d)[:, :length].transpose(1, 2).contiguous()
        values = cache[1][tables].reshape(n, per_seq * bs, hkv, d)[:, :length].transpose(1, 2).contiguous()
        q4 = query.view(n, length, hq, d).transpose(1, 2)
        paths: dict[str, Callable[[], torch.Tensor]] = {
            "sdpa": lambda q4=q4, keys=keys, values=values, query=query: F.scaled_dot_product_attention(
                q4, keys, values, is_causal=True, scale=d ** -0.5,
                enable_gqa=True).transpose(1, 2).reshape(query.shape),
        }
        for name, kernel in kernels.items():
            paths[name] = functools.partial(kernel, query, cache, tables, starts, lens, d ** -0.5)
        expected = paths["sdpa"]().float()
        diffs = {name: (paths[name]().float() - expected).abs().max().item() for name in kernels}
        times = alternate(paths, ns.rounds)
        med = {name: statistics.median(v) for name, v in times.items()}
        row: dict[str, object] = {"median_ms": med, "rounds_ms": times, "max_abs_diff": max(diffs.values()),
                                  "max_abs_diffs": diffs}
        for name in kernels:
            row[f"sdpa_over_{name}"] = med["sdpa"] / med[name]
        result["shapes"][text] = row
        print(f"{text:>8}: sdpa {med['sdpa']:.2f} ms" + "".join(
            f", {name} {med[name]:.2f} ms ({med['sdpa'] / med[name]:.2f}x, max |{name} - sdpa| {diffs[name]:.4f})"
            for name in kernels), flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
