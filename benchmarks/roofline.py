"""The decode step of one sequence (c=1) against the memory roofline, at real model shapes, for bfloat16, W8A8 and
4-bit (GPTQ) weights, with where the rest of the step goes.

    python -m benchmarks.roofline --shapes 0.7b --rounds 5 --threads 2

Each shape is a random Llama checkpoint written once under ``--dir`` (bfloat16 safetensors, and a GPTQ v1 copy:
symmetric, groups of 128, random codes and scales, the lm_head left in bfloat16 as GPTQ checkpoints leave it). One
``EngineCore`` per format is loaded (``bf16``: the bfloat16 checkpoint; ``w8a8``: the same with ``--quantization
w8a8``, lm_head included; ``int4``: the GPTQ checkpoint, ``Int4PackLinearMethod``); then, round after round and
format after format (interleaved, so that a shared machine's drift falls on all alike), each decodes ``--tokens``
greedy tokens of a fresh 16-token prompt, and the read bandwidth (a 1 GiB bfloat16 sum, as in
``benchmarks.int4_linear``) is measured in the same round. A decode step's time is ``EngineCore.last_step`` of the
steps that run the sequence's one token; the figure is the median over the round's steps, then the median over the
rounds. The roofline is the bytes the step's linears hold (what each method reads per token: oneDNN's packed
bfloat16 copy, int8 codes and scales, packed 4-bit codes and their scale table; the embedding row and the short KV
cache are left out) over that round's bandwidth.

A last, separate pass per format times the pieces of a decode step (perf_counter around every linear's forward, the
lm_head apart, and the sampler): ``rest`` is the step less those (attention, norms, rotary, residual adds, the
runner's Python and the engine's scheduling and bookkeeping). Prints markdown tables and writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.int4_linear import read_bandwidth
from benchmarks.report import machine_info
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.models.int4 import pack_int32
from engine.models.layers.linear import Linear

# name: (hidden, MLP, layers, query heads, KV heads, vocabulary); head dim hidden / heads
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "0.7b": (2048, 8192, 8, 32, 8, 49152),        # the 0.7B: SmolLM2-1.7B's widths, 8 layers
    "3b-8l": (3072, 8192, 8, 24, 8, 128256),      # Llama-3.2-3B's widths and vocabulary, 8 of its 28 layers
}
GROUP = 128
PROMPT = 16


def _config(shape: tuple[int, int, int, int, int, int]) -> dict[str, Any]:
    hidden, mlp, layers, heads, kv, vocab = shape
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": mlp, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2, "hidden_act": "silu"}


def _projections(shape: tuple[int, int, int, int, int, int]) -> dict[str, tuple[int, int]]:
    hidden, mlp, _, heads, kv, _ = shape
    kv_dim = hidden // heads * kv
    return {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_dim, hidden),
            "self_attn.v_proj": (kv_dim, hidden), "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (mlp, hidden), "mlp.up_proj": (mlp, hidden), "mlp.down_proj": (hidden, mlp)}


def write_checkpoints(root: Path, name: str) -> tuple[Path, Path]:
    """``root/name/bf16`` and ``root/name/gptq`` (written once, reused)."""
    shape = SHAPES[name]
    bf16, gptq = root / name / "bf16", root / name / "gptq"
    if (gptq / "config.json").exists():
        return bf16, gptq
    gen = torch.Generator().manual_seed(0)
    hidden, _, layers, _, _, vocab = shape
    common = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * 0.5).bfloat16(),
              "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16(),
              "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    dense: dict[str, torch.Tensor] = dict(common)
    packed: dict[str, torch.Tensor] = dict(common)
    for i in range(layers):
        base = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[base + norm + ".weight"] = packed[base + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for proj, (out, cols) in _projections(shape).items():
            dense[base + proj + ".weight"] = (torch.randn(out, cols, generator=gen) * 0.02).bfloat16()
            codes = torch.randint(0, 16, (cols, out), generator=gen, dtype=torch.int32)        # [in, out]
            packed[base + proj + ".qweight"] = pack_int32(codes, 0)
            packed[base + proj + ".qzeros"] = pack_int32(torch.full((cols // GROUP, out), 7), 1)  # v1: zero 8 - 1
            packed[base + proj + ".scales"] = (torch.rand(cols // GROUP, out, generator=gen) * 0.004).half()
    for path, tensors, qc in ((bf16, dense, None),
                              (gptq, packed, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                              "desc_act": False, "sym": True, "checkpoint_format": "gptq"})):
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"))
        cfg = _config(shape) | ({} if qc is None else {"quantization_config": qc})
        (path / "config.json").write_text(json.dumps(cfg))
    return bf16, gptq


def _tensor_bytes(obj: Any, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        key = id(obj) if obj.is_mkldnn else obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def linear_bytes(model: torch.nn.Module) -> int:
    """The bytes a decode step reads from the linears' methods (each tensor once)."""
    seen: set[int] = set()
    return sum(_tensor_bytes(m.method, seen) or (0 if m.weight is None else _tensor_bytes(m.weight, seen))
               for m in model.modules() if isinstance(m, Linear))


def _prompt(core: EngineCore, salt: int) -> list[int]:
    """A fresh prompt per call (no prefix-cache hit from an earlier round)."""
    return [3 + (salt * 7919 + j * 131) % (core.vocab_size - 3) for j in range(PROMPT)]


def _decode(core: EngineCore, tokens: int, salt: int) -> list[float]:
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    core.add_request(f"r{salt}", _prompt(core, salt), sp)
    steps: list[float] = []
    while core.has_unfinished_requests():
        core.step()
        st = core.last_step
        if st is not None and st.num_batched_tokens == 1:
            steps.append(st.duration_s)
    return steps[1:]   # the first decode step warms what prefill did not touch


def _timed(fn: Callable[..., Any], bucket: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        bucket.append(time.perf_counter() - t0)
        return out
    return wrapper


def breakdown(core: EngineCore, tokens: int, salt: int) -> dict[str, float]:
    """Milliseconds per decode step in the linears, the lm_head, the sampler and the rest (medians over steps)."""
    worker = core.executor.worker   # type: ignore[attr-defined]
    model, runner = worker.model, worker.runner
    linears: list[float] = []
    head: list[float] = []
    sampler: list[float] = []
    patched = []
    for m in model.modules():
        if isinstance(m, Linear):
            m.forward = _timed(m.forward, head if m.is_lm_head else linears)   # type: ignore[method-assign]
            patched.append(m)
    runner.sampler = _timed(runner.sampler, sampler)
    per_step: list[tuple[float, float, float, float]] = []
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    core.add_request(f"b{salt}", _prompt(core, salt), sp)
    first = True
    while core.has_unfinished_requests():
        for bucket in (linears, head, sampler):
            bucket.clear()
        core.step()
        st = core.last_step
        if st is not None and st.num_batched_tokens == 1:
            if not first:
                per_step.append((st.duration_s, sum(linears), sum(head), sum(sampler)))
            first = False
    for m in patched:
        del m.forward
    del runner.sampler
    step, lin, lm, smp = (statistics.median(v[i] for v in per_step) * 1e3 for i in range(4))
    return {"step_ms": step, "linears_ms": lin, "lm_head_ms": lm, "sampler_ms": smp,
            "rest_ms": step - lin - lm - smp}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="0.7b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--formats", default="bf16,w8a8,int4")
    p.add_argument("--tokens", type=int, default=33, help="greedy tokens per round (decode steps + 1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default="/tmp/sluice-roofline", help="where the random checkpoints are written")
    p.add_argument("--out", default=None, help="write the JSON result here")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    formats = [f for f in ns.formats.split(",") if f]
    print(f"# {machine_info()}; torch {torch.__version__}, {ns.threads} threads; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    results: list[dict[str, Any]] = []
    for name in ns.shapes.split(","):
        bf16, gptq = write_checkpoints(Path(ns.dir), name)
        cores: dict[str, EngineCore] = {}
        for fmt in formats:
            path = gptq if fmt == "int4" else bf16
            cores[fmt] = EngineCore(EngineConfig(
                model=str(path), dtype="bfloat16", quantization="w8a8" if fmt == "w8a8" else None,
                max_num_seqs=1, max_num_batched_tokens=256, kv_cache_memory=2**28, num_threads=ns.threads,
                disable_log_stats=True))
        held = {f: linear_bytes(c.executor.worker.model) for f, c in cores.items()}   # type: ignore[attr-defined]
        rounds: dict[str, list[tuple[float, float]]] = {f: [] for f in formats}
        loads: list[float] = []
        salt = 0
        for _ in range(ns.rounds):
            bandwidth = read_bandwidth()
            loads.append(os.getloadavg()[0])
            for fmt in formats:
                salt += 1
                step = statistics.median(_decode(cores[fmt], ns.tokens, salt))
                rounds[fmt].append((step * 1e3, held[fmt] / bandwidth * 1e3))
        print(f"\n## {name}: hidden/MLP/layers/heads/KV heads/vocab {SHAPES[name]}; load average "
              f"{min(loads):.1f}-{max(loads):.1f}")
        print("| format | linears held | decode step, ms | roofline, ms | step ÷ roofline | timed pass: step "
              "| linears | lm_head | sampler | rest |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for fmt in formats:
            step = statistics.median(s for s, _ in rounds[fmt])
            ratio = statistics.median(s / r for s, r in rounds[fmt])
            roof = statistics.median(r for _, r in rounds[fmt])
            salt += 1
            parts = breakdown(cores[fmt], ns.tokens, salt)
            print(f"| {fmt} | {held[fmt] / 2**20:.0f} MiB | {step:.2f} | {roof:.2f} | **{ratio:.2f}×** "
                  f"| {parts['step_ms']:.2f} | {parts['linears_ms']:.2f} | {parts['lm_head_ms']:.2f} "
                  f"| {parts['sampler_ms']:.2f} | {parts['rest_ms']:.2f} |")
            results.append({"shape": name, "format": fmt, "held_bytes": held[fmt], "rounds": rounds[fmt],
                            "step_ms": step, "roofline_ms": roof, "ratio": ratio, "breakdown": parts,
                            "load_average": loads})
        cores.clear()
    if ns.out:
        Path(ns.out).write_text(json.dumps({"command": "python -m benchmarks.roofline " + " ".join(
            argv if argv is not None else sys.argv[1:]), "machine": machine_info(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
