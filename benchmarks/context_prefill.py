"""Prefill chunks after cached context, one layer: the decode kernel row by row against gather + masked SDPA.

    python -m benchmarks.context_prefill --shapes 16x1024+128,1x96+160,1x2048+2048 --threads 1,2 --rounds 5

For each shape ``NxC+Q`` (N sequences, C tokens cached, Q new), bfloat16 queries and a bfloat16 paged cache of
the default model's shape (9 query heads, 3 kv heads, head_dim 64, 16-token blocks scattered at random):
``sdpa`` is ``TorchAttentionBackend._prefill`` per sequence (block gather, then SDPA with a causal mask), the
path CPUs without AMX took; ``rows`` is ``_context_prefills``, one ``cpu_ops.paged_decode_attention`` call
with a row per new token (what the engine runs for chunks of up to ``ROWS_MAX_QUERY`` = 512 tokens). Time
per layer call, the median of ``--rounds``, the two alternating round by round, at each thread count; the
largest difference between their outputs too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from benchmarks.report import alternate, machine_info
from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu_ops


def _shape(text: str) -> tuple[int, int, int]:
    n, _, rest = text.lower().partition("x")
    context, _, new = rest.partition("+")
    return int(n), int(context), int(new)


def _measure(ops: Any, n: int, context: int, new: int, threads: list[int], rounds: int) -> list[dict[str, Any]]:
    hq, hkv, d, block_size, num_blocks = 9, 3, 64, 16, 4096
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).bfloat16()
    seq_len = context + new
    per_seq = -(-seq_len // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:n * per_seq].view(n, per_seq).contiguous()
    query = torch.randn(n * new, hq, d, generator=gen).bfloat16()
    key = torch.randn(n * new, hkv, d, generator=gen).bfloat16()
    rows_backend = TorchAttentionBackend(decode_kernel=ops.paged_decode_attention)
    sdpa_backend = TorchAttentionBackend()
    scale = d ** -0.5
    # The per-row tables are derived once per step, for all layers: the first call pays for them.
    step = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=tables,
                             seq_lens=torch.full((n,), seq_len), query_lens=[new] * n, seq_lens_host=[seq_len] * n,
                             num_decodes=0, block_size=block_size, backend=rows_backend)

    def sdpa() -> torch.Tensor:
        return torch.cat([sdpa_backend._prefill(query[i * new:(i + 1) * new], key[i * new:(i + 1) * new],
                                                key[i * new:(i + 1) * new], cache, step, i, scale) for i in range(n)])

    def rows() -> torch.Tensor:
        return rows_backend._context_prefills(query, cache, step, 0, n, scale)

    diff = (rows().float() - sdpa().float()).abs().max().item()
    results = []
    for count in threads:
        torch.set_num_threads(count)
        times = alternate({"sdpa": sdpa, "rows": rows}, rounds)
        results.append({"threads": count, "max_abs_diff": diff,
                        **{f"{k}_ms": round(statistics.median(v), 2) for k, v in times.items()}})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.context_prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16x1024+128,1x96+160,4x256+512,1x512+512")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args(argv)
    ops = cpu_ops()
    if ops is None:
        print("the CPU kernels did not build", file=sys.stderr)
        return 1
    threads = [int(t) for t in ns.threads.split(",")]
    for text in ns.shapes.split(","):
        for row in _measure(ops, *_shape(text), threads, ns.rounds):
            print(json.dumps({"shape": text, **row}), flush=True)
    print(json.dumps({"machine": machine_info()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
