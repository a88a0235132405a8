"""One GPU's step times for a real-shape model with random weights, against the machine's own roofline.

    python -m benchmarks.gpu_step --batches 1,32,128 --context 1024 --prefill 2048,8192 --out gpu_step.json

Builds Llama-3-8B's shapes (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary 128256)
in bfloat16 directly on the device with random weights (no checkpoint), a paged KV cache of 16-token blocks and
the Triton attention backend, then measures:

- the device's copy bandwidth (a device-to-device copy of 4 GiB: bytes read + written per second) and its bfloat16
  matmul rate (8192^3 products);
- a decode step (forward + logits of every row) at each batch, every sequence ``--context`` tokens long, eager and
  replayed from a CUDA graph, against the roofline (weight bytes + the KV bytes the step reads) / copy bandwidth;
- a prefill step of each ``--prefill`` token count (fresh 2048-token prompts, or one shorter one): TFLOP/s of
  its matmuls and attention against the measured matmul rate.

Writes the figures as JSON (``--out``) and prints them. Refuses to run without CUDA. Async vs sync scheduling and
HF transformers' ``generate`` on the same machine are measured by their own scripts, not here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                 max_position_embeddings=8192, tie_word_embeddings=False)
BLOCK = 16


def _time(fn: Callable[[], Any], steps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the device (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(steps: int) -> float:
    """Bytes per second a device-to-device copy moves (read + written)."""
    src = torch.empty(2**31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), steps)
    return 2 * src.numel() * src.element_size() / seconds


def matmul_rate(steps: int) -> float:
    """bfloat16 FLOP/s of an 8192^3 matmul."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / _time(lambda: a @ b, steps)


def build(num_blocks: int) -> tuple[Any, Any, list[torch.Tensor]]:
    """The model with random weights, the Triton backend and a KV cache of ``num_blocks`` blocks."""
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.device import get_device
    from engine.device.kernel_choice import KernelChoice
    from engine.models.config import ModelConfig
    from engine.models.llama import build_model

    config = ModelConfig(**LLAMA3_8B)  # type: ignore[arg-type]
    model = build_model(config, torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    model.use_kernels(KernelChoice.torch())
    backend = TritonAttentionBackend()
    caches = backend.allocate_kv_caches(get_device("cuda"), config.num_layers, num_blocks, BLOCK, config.num_kv_heads,
                                        config.head_dim, torch.bfloat16)
    for cache in caches:   # keys and values of plausible size (zeros would make every softmax uniform)
        cache.normal_(0.0, 1.0, generator=gen)
    return model, backend, caches


def _layout(query_lens: list[int], seq_lens: list[int], num_blocks: int) -> tuple[Any, torch.Tensor]:
    """Each sequence gets its own run of blocks; returns (the step layout, positions)."""
    from engine.attention.backend import StepLayout

    per_seq = -(-max(seq_lens) // BLOCK)
    if per_seq * len(seq_lens) > num_blocks:
        raise ValueError(f"{len(seq_lens)} sequences of {max(seq_lens)} tokens need more than {num_blocks} blocks")
    tables = np.arange(len(seq_lens) * per_seq, dtype=np.int64).reshape(len(seq_lens), per_seq)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    rows = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    layout = StepLayout(slot_mapping=torch.from_numpy(slots), block_tables=tables, query_lens=query_lens,
                        seq_lens=seq_lens, num_decodes=num_decodes, block_size=BLOCK)
    return layout, torch.from_numpy(positions)


def decode(model: Any, backend: Any, caches: list[torch.Tensor], batch: int, context: int, steps: int,
           bandwidth: float) -> dict[str, Any]:
    from engine.device.cuda import CudaDevice
    from engine.worker.graphs import DecodeGraphs, device_recorder

    num_blocks = caches[0].shape[1]
    layout, positions = _layout([1] * batch, [context + 1] * batch, num_blocks)
    meta = backend.build_metadata(layout, torch.device("cuda"))
    ids = torch.randint(0, model.config.vocab_size, (batch,), device="cuda")
    positions = positions.cuda()
    with torch.inference_mode():
        eager = _time(lambda: model.compute_logits(model(ids, positions, caches, meta), dtype=None), steps)
        graphs = DecodeGraphs(model, backend, caches, sizes=[batch], max_seq_len=context + 1, block_size=BLOCK,
                              device=torch.device("cuda"))
        graphs.capture(device_recorder(CudaDevice(0)))

        def replay() -> None:
            hidden = graphs.forward(ids, positions, meta)
            assert hidden is not None
            model.compute_logits(hidden, dtype=None)

        graph = _time(replay, steps)
    mc = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= mc.vocab_size * mc.hidden_size * 2   # the embedding table: only `batch` rows are read
    kv_bytes = batch * (context + 1) * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    roofline = (weight_bytes + kv_bytes) / (bandwidth / 2)   # a copy's bandwidth counts read + write
    return {"batch": batch, "context": context, "eager_ms": eager * 1e3, "graph_ms": graph * 1e3,
            "roofline_ms": roofline * 1e3, "graph_over_roofline": graph / roofline,
            "tokens_per_s": batch / graph}


def prefill(model: Any, backend: Any, caches: list[torch.Tensor], tokens: int, steps: int,
            rate: float) -> dict[str, Any]:
    prompt = min(tokens, 2048)
    lens = [prompt] * (tokens // prompt) + ([tokens % prompt] if tokens % prompt else [])
    layout, positions = _layout(lens, lens, caches[0].shape[1])
    meta = backend.build_metadata(layout, torch.device("cuda"))
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
    last = torch.from_numpy(np.cumsum(lens) - 1).cuda()
    positions = positions.cuda()
    with torch.inference_mode():
        seconds = _time(lambda: model.compute_logits(model(ids, positions, caches, meta)[last], dtype=None), steps)
    mc = model.config
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    attention = 2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim * sum(n * (n + 1) // 2 for n in lens)
    flops = 2 * linear * tokens + attention + 2 * len(lens) * mc.hidden_size * mc.vocab_size
    return {"tokens": tokens, "prompts": lens, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
            "share_of_matmul_rate": flops / seconds / rate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", default="2048,8192")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="gpu_step.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu_step needs a CUDA device: torch sees none (it measures GPU step times against the "
              "GPU's own bandwidth and matmul rate)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    prefills = [int(t) for t in args.prefill.split(",")]
    bandwidth, rate = copy_bandwidth(args.steps), matmul_rate(args.steps)
    tokens_needed = max(max(batches) * (args.context + 1), max(prefills) + 2048)
    model, backend, caches = build(-(-tokens_needed // BLOCK) + max(batches))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "Llama-3-8B shapes, random",
        "copy_bandwidth_gb_s": bandwidth / 1e9, "bf16_matmul_tflops": rate / 1e12,
        "decode": [decode(model, backend, caches, b, args.context, args.steps, bandwidth) for b in batches],
        "prefill": [prefill(model, backend, caches, t, args.steps, rate) for t in prefills],
    }
    text = json.dumps(result, indent=2)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
