"""One mixture-of-experts layer's routed experts at Qwen3-30B-A3B's shape (hidden 2048, 64 experts of 768, top-8),
on the CPU device's methods: bfloat16 experts (``GroupedMoEMethod``, oneDNN-packed) against W8A8 int8 experts
(``Int8GroupedMoEMethod``), and PyTorch's ``torch._grouped_mm`` (what transformers' default ``grouped_mm`` experts
call) over the same bfloat16 weights. Three layers' weights in turn (none stays in cache), interleaved rounds,
medians in ms per layer.

    python -m benchmarks.moe_layer [--rows 1,32,128] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.device import CpuDevice
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.moe_routing import select_experts
from engine.models.moe_config import Routing

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 64, 8


def layer(routing: Routing, int8: bool, device: CpuDevice, seed: int) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    m = FusedMoE(routing, HIDDEN, INTER)
    with torch.no_grad():
        m.w13.copy_(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.02)
        m.w2.copy_(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.02)
    m = m.to(torch.bfloat16)
    if int8:
        m.quantize_w8a8()
    m.use_kernels(device.kernel_choice(torch.bfloat16, 0, 1 if int8 else 0))
    return m


def grouped_mm(m: FusedMoE) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    w13, w2 = m.w13.transpose(1, 2), m.w2.transpose(1, 2)

    def run(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(logits, m.routing)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0).to(torch.int32)
        rows = x.index_select(0, order // TOP_K)
        gate, up = torch._grouped_mm(rows, w13, offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm((F.silu(gate) * up).contiguous(), w2, offs=offs)
        out = torch.zeros(x.shape, dtype=torch.float32)
        out.index_add_(0, order // TOP_K, y.float() * weights.reshape(-1)[order, None])
        return out.to(x.dtype)

    return run


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,32,128")
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args()
    device = CpuDevice()
    routing = Routing(EXPERTS, TOP_K, renormalize=True)
    bf16 = [layer(routing, False, device, s) for s in range(3)]
    variants: dict[str, list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
        "bf16 (GroupedMoEMethod)": list(bf16),
        "w8a8 (Int8GroupedMoEMethod)": [layer(routing, True, device, s) for s in range(3)],
        "torch._grouped_mm (bf16)": [grouped_mm(m) for m in bf16],
    }
    print(f"{'rows':>5} " + " ".join(f"{name:>28}" for name in variants))
    for rows in (int(r) for r in ns.rows.split(",")):
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
        logits = torch.randn(rows, EXPERTS)
        times: dict[str, list[float]] = {name: [] for name in variants}
        with torch.inference_mode():
            for _ in range(ns.rounds + 1):
                for name, fns in variants.items():
                    start = time.perf_counter()
                    for fn in fns:
                        fn(x, logits)
                    times[name].append((time.perf_counter() - start) / len(fns) * 1000)
        print(f"{rows:>5} " + " ".join(f"{statistics.median(t[1:]):>28.2f}" for t in times.values()))


if __name__ == "__main__":
    main()
