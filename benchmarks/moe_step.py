"""Decode step time of a mixture-of-experts model against a dense model of equal active parameters and against
transformers' own MoE forward, in one process, interleaved; and MLA's KV bytes per token against MHA's.

    python -m benchmarks.moe_step --num-seqs 1,32,128 --layers 4 --repeats 7

Writes random Hugging Face checkpoints to a temporary folder (no download) and loads them with
``engine.models.load_model``:

- ``moe``: Qwen3-MoE's block scaled to this machine: hidden 2048, 16 query / 4 KV heads of 128 (q/k norm),
  ``--experts`` experts of intermediate 768, top ``--top-k`` (renormalised), every layer sparse;
- ``dense``: Qwen3 with the same attention and one MLP of intermediate ``top_k * 768``: the same active parameters
  per token;

both with a small vocabulary (``--vocab``, 8192 by default) so the lm_head does not dominate the step, in bfloat16
where the CPU computes it natively (avx512_bf16 or AMX) else float32, prepared with the CPU device's kernel choice
as the worker does (``prepare_model``). A decode step is ``--num-seqs`` sequences of ``--context`` cached tokens
(random keys and values in the CPU backend's paged cache) with one new token each: forward and logits. Beside them,
transformers' ``Qwen3MoeForCausalLM`` (the same weights, its default experts implementation, named in the output)
runs the same step on a ``DynamicCache`` of the same length, cropped back after each step.

The process is set up as the engine's (``set_openmp_defaults``, ``use_huge_pages``) before torch loads. Rounds
interleave the three models at every size (the first round warms up and is dropped); figures are medians.
The floor is the bytes a step must read (the weights it touches: attention, the experts any token of the step
routes to, the lm_head, the embedding rows; plus the KV cache) over the read bandwidth measured in the same run.
"""
# ruff: noqa: E402  (the engine's process settings come before torch's import)
from __future__ import annotations

from engine.entrypoints.process import set_openmp_defaults, use_huge_pages

set_openmp_defaults()   # what the engine's entry points do before torch loads: its OpenMP waits, huge pages
use_huge_pages()

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    DeepseekV3Config,
    DynamicCache,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine.attention.backend import AttentionBackend, StepLayout
from engine.device import CpuDevice
from engine.models import CausalLM, load_model
from engine.models.config import config_from_hf
from engine.models.dtype import resolve_dtype
from engine.worker.worker import prepare_model

BLOCK = 16
MOE_INTERMEDIATE = 768


def hf_configs(ns: argparse.Namespace) -> tuple[Qwen3MoeConfig, Qwen3Config]:
    common: dict[str, Any] = dict(vocab_size=ns.vocab, hidden_size=2048, num_hidden_layers=ns.layers,
                                  num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                  max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2)
    moe = Qwen3MoeConfig(**common, moe_intermediate_size=MOE_INTERMEDIATE,
                         intermediate_size=ns.top_k * MOE_INTERMEDIATE,
                         num_experts=ns.experts, num_experts_per_tok=ns.top_k, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[])
    dense = Qwen3Config(**common, intermediate_size=ns.top_k * MOE_INTERMEDIATE)
    return moe, dense


def write_random(model_cls: type[PreTrainedModel], config: Any, folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    """A random model (transformers' init: normal(0, 0.02) weights, near-uniform routing) saved to ``folder``."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)   # initialised in the model dtype: half the memory and time of float32
    try:
        model = model_cls(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(str(folder))
    return model


class SluiceDecode:
    """Decode steps of one loaded model on the CPU backend's paged cache: ``num_seqs`` sequences, each with its own
    run of blocks holding ``context`` random cached tokens, one new token each."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, device: CpuDevice, dtype: torch.dtype,
                 num_seqs: int, context: int) -> None:
        self.model, self.backend = model, backend
        per_seq = -(-(context + 1) // BLOCK)
        self.caches = backend.allocate_kv_caches(device, model.num_local_layers, num_seqs * per_seq + 1, BLOCK,
                                                 model.num_local_kv_heads, model.kv_head_dim, dtype,
                                                 model.kv_planes)
        gen = torch.Generator().manual_seed(1)
        for cache in self.caches:
            cache.copy_(torch.randn(cache.shape, generator=gen))
        tables = 1 + np.arange(num_seqs * per_seq, dtype=np.int64).reshape(num_seqs, per_seq)
        slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
        self.layout = StepLayout(slot_mapping=torch.from_numpy(slots), block_tables=tables,
                                 query_lens=[1] * num_seqs, seq_lens=[context + 1] * num_seqs,
                                 num_decodes=num_seqs, block_size=BLOCK)
        self.ids = torch.randint(3, model.config.vocab_size, (num_seqs,), generator=gen)
        self.positions = torch.full((num_seqs,), context, dtype=torch.int64)

    def step(self) -> None:
        meta = self.backend.build_metadata(self.layout, torch.device("cpu"))   # per step, as the runner builds it
        hidden = self.model(self.ids, self.positions, self.caches, meta)
        assert isinstance(hidden, torch.Tensor)
        self.model.compute_logits(hidden, dtype=None)


class HfDecode:
    """transformers' decode step: ``num_seqs`` rows of one token on a ``DynamicCache`` of ``context`` random tokens,
    cropped back after each step so that every step is the same."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, num_seqs: int, context: int) -> None:
        cfg = model.config
        self.model = model
        self.cache = DynamicCache(config=cfg)
        gen = torch.Generator().manual_seed(1)
        shape = (num_seqs, cfg.num_key_value_heads, context, cfg.head_dim)
        for layer in range(cfg.num_hidden_layers):
            self.cache.update(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype),
                              layer)
        self.ids = torch.randint(3, cfg.vocab_size, (num_seqs, 1), generator=gen)
        self.positions = torch.full((num_seqs, 1), context, dtype=torch.int64)

    def step(self) -> None:
        self.model(input_ids=self.ids, position_ids=self.positions, past_key_values=self.cache, use_cache=True,
                   logits_to_keep=1)
        self.cache.crop(-1)


def read_bandwidth(repeats: int) -> float:
    """Bytes per second a sum over 1 GiB of float32 reads (median of ``repeats``)."""
    x = torch.ones(2**28)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def step_bytes(model: CausalLM, num_seqs: int, context: int, experts_touched: float, element_size: int) -> float:
    """Bytes a decode step must read, from the config (a packed linear's weight is no parameter): attention's
    projections, the dense MLP or the float32 router and the touched experts, the lm_head, the embedding rows,
    the KV cache."""
    c = model.config
    attention = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    if c.moe is None:
        mlp = 3 * c.hidden_size * c.intermediate_size * element_size
    else:
        mlp = (experts_touched * 3 * c.hidden_size * c.moe.intermediate_size * element_size
               + c.moe.routing.num_experts * c.hidden_size * 4)
    weights = c.num_layers * (attention * element_size + mlp) + (c.vocab_size + num_seqs) * c.hidden_size * element_size
    return weights + num_seqs * (context + 1) * model.kv_bytes_per_token(element_size)


def expected_experts(num_experts: int, top_k: int, num_seqs: int) -> float:
    """Experts at least one of ``num_seqs`` tokens routes to, with uniform routing: E (1 - (1 - k/E)^N)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_seqs)


def mla_kv_bytes(element_size: int) -> dict[str, Any]:
    """DeepSeek-V3's KV bytes per token (61 layers, kv_lora_rank 512 + rope 64) from ``CausalLM.kv_bytes_per_token``
    of the full config built on the meta device (no memory), against MHA over its 128 heads: the same model with
    plain attention as this engine caches it (keys and values in one head_dim, 192), and the exact K 192 + V 128."""
    config = config_from_hf(DeepseekV3Config().to_dict(), None, has_lm_head=True)
    assert config.mla is not None
    with torch.device("meta"):
        mla = CausalLM(config).kv_bytes_per_token(element_size)
    mla_cfg, layers, heads = config.mla, config.num_layers, config.num_heads
    mha_engine = 2 * layers * heads * mla_cfg.qk_head_dim * element_size
    mha_exact = layers * heads * (mla_cfg.qk_head_dim + mla_cfg.v_head_dim) * element_size
    return {"layers": layers, "heads": heads, "kv_lora_rank": mla_cfg.kv_lora_rank,
            "qk_rope_head_dim": mla_cfg.qk_rope_head_dim, "qk_head_dim": mla_cfg.qk_head_dim,
            "v_head_dim": mla_cfg.v_head_dim, "element_size": element_size, "mla_bytes_per_token": mla,
            "mha_bytes_per_token_engine_layout": mha_engine, "mha_bytes_per_token_k192_v128": mha_exact,
            "mha_over_mla": round(mha_exact / mla, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", default="1,32,128")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=128, help="cached tokens of each sequence")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 with avx512_bf16 or AMX, else float32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' forward")
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    sizes = [int(n) for n in ns.num_seqs.split(",")]
    dtype = resolve_dtype(ns.dtype)
    device = CpuDevice()
    moe_cfg, dense_cfg = hf_configs(ns)
    tmp = tempfile.TemporaryDirectory()
    hf = write_random(Qwen3MoeForCausalLM, moe_cfg, Path(tmp.name) / "moe", dtype)
    write_random(Qwen3ForCausalLM, dense_cfg, Path(tmp.name) / "dense", dtype)   # only its checkpoint is kept
    models: dict[str, CausalLM] = {}
    for name in ("moe", "dense"):
        models[name] = load_model(str(Path(tmp.name) / name), dtype)
        prepare_model(models[name], device, dtype)
    tmp.cleanup()
    backend = device.attention_backend()
    steps: dict[tuple[str, int], Callable[[], None]] = {}
    for n in sizes:
        for name, model in models.items():
            steps[name, n] = SluiceDecode(model, backend, device, dtype, n, ns.context).step
        if not ns.no_hf:
            steps["transformers", n] = HfDecode(hf, dtype, n, ns.context).step
    names = ["moe", "dense"] + ([] if ns.no_hf else ["transformers"])
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    bandwidth: list[float] = []
    with torch.inference_mode():
        for rep in range(ns.repeats + 1):
            bandwidth.append(read_bandwidth(3))
            for n in sizes:
                for name in names:
                    t0 = time.perf_counter()
                    steps[name, n]()
                    if rep:   # the first round warms oneDNN's primitives and the allocator
                        times[name, n].append(time.perf_counter() - t0)
    read_bw = statistics.median(bandwidth)
    rows = []
    for n in sizes:
        ms = {name: 1000 * statistics.median(times[name, n]) for name in names}
        touched = expected_experts(ns.experts, ns.top_k, n)
        floor = {name: 1000 * step_bytes(models[name], n, ns.context, touched, dtype.itemsize) / read_bw
                 for name in models}
        row: dict[str, Any] = {"num_seqs": n, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                               "moe_over_dense": round(ms["moe"] / ms["dense"], 2),
                               "experts_touched_per_layer": round(touched, 1),
                               "moe_floor_ms": round(floor["moe"], 2), "dense_floor_ms": round(floor["dense"], 2),
                               "moe_over_floor": round(ms["moe"] / floor["moe"], 2)}
        if not ns.no_hf:
            row["transformers_over_moe"] = round(ms["transformers"] / ms["moe"], 2)
        rows.append(row)
    result: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.moe_step", *(argv if argv is not None else sys.argv[1:])]),
        "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers_experts": None if ns.no_hf else hf.config._experts_implementation,
        "model": f"qwen3_moe shape: {ns.layers} layers, hidden 2048, {ns.experts} experts x {MOE_INTERMEDIATE}, "
                 f"top-{ns.top_k}, vocab {ns.vocab}; dense: intermediate {ns.top_k * MOE_INTERMEDIATE}",
        "context": ns.context, "repeats": ns.repeats, "read_bandwidth_gb_s": round(read_bw / 1e9, 1),
        "decode": rows, "kv_bytes_per_token": mla_kv_bytes(2),
    }
    text = json.dumps(result, indent=2)
    print(text)
    header = ["N", *[f"{n} ms" for n in names], "moe/dense", "moe floor", "moe/floor",
              *([] if ns.no_hf else ["hf/moe"])]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        cells = [r["num_seqs"], *[r[f"{n}_ms"] for n in names], r["moe_over_dense"], r["moe_floor_ms"],
                 r["moe_over_floor"], *([] if ns.no_hf else [r["transformers_over_moe"]])]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
