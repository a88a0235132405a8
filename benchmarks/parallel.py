"""Tensor and pipeline parallel against one process: a 32-sequence decode step, and the communication in it.

    python -m benchmarks.parallel --configs tp1,tp2,pp2 --num-seqs 32 --out parallel.json

Drives EngineCore directly (no server) for each configuration in turn, interleaving rounds so a slow spell of
the shared machine falls on all of them alike, and records the median decode-step time at full batch. The model
is a random-weight Llama with the default model's depth and vocabulary but 8 attention heads (SmolLM2-135M's
9 do not divide over 2 ranks), written once with transformers; ``--model`` takes another.

The communication of a step is timed separately, by the same collectives on the same sizes between two gloo
processes on this machine (``comm``): TP 2 all-reduces each layer's attention and MLP outputs and the embedding,
and gathers the logits; PP 2 sends each micro-batch's hidden states and residual to stage 1 and its final hidden
states back. Those times, times the calls per step, estimate what a step spends communicating; on a real
multi-device host the same count of calls runs over NVLink/HCCS instead of loopback TCP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import machine_info, utc_timestamp

CONFIGS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
MODEL = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536,
             num_hidden_layers=30, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)


def write_model(directory: Path) -> Path:
    """A random-weight Llama (MODEL) in bfloat16, written by transformers, once."""
    if (directory / "config.json").exists():
        return directory
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16"))
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def decode_steps(model: str, tp: int, pp: int, num_seqs: int, input_len: int, output_len: int,
                 dtype: str) -> list[float]:
    """Durations (ms) of the decode steps that ran all ``num_seqs`` sequences."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.core.sampling_params import SamplingParams

    config = EngineConfig(model=model, dtype=dtype, max_num_seqs=num_seqs, kv_cache_memory=2**30,
                          max_num_batched_tokens=max(2048, num_seqs), tensor_parallel_size=tp,
                          pipeline_parallel_size=pp)
    core = EngineCore(config, show_progress=False)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for i in range(num_seqs):
            core.add_request(str(i), [100 + (i * 7 + j) % 30000 for j in range(input_len)], sp)
        steps: list[float] = []
        while core.has_unfinished_requests():
            core.step()
            st = core.last_step
            if st is not None and st.num_batched_tokens == num_seqs:
                steps.append(1e3 * st.duration_s)
        return steps
    finally:
        core.close()


def _comm_rank(rank: int, port: int, shapes: dict[str, tuple[int, ...]], rounds: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result: dict[str, float] = {}
    for name, shape in shapes.items():
        x = torch.randn(shape).to(torch.bfloat16)
        times = []
        for _ in range(rounds):
            dist.barrier()
            t = time.perf_counter()
            if name.startswith("all_reduce"):
                dist.all_reduce(x)
            elif name.startswith("all_gather"):
                parts = [torch.empty_like(x) for _ in range(2)]
                dist.all_gather(parts, x)
            elif rank == 0:   # a send and the matching receive: one hop of a pipeline
                dist.send(x, 1)
            else:
                dist.recv(x, 0)
            times.append(time.perf_counter() - t)
        result[name] = 1e3 * statistics.median(times)
    if rank == 1:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def comm(num_seqs: int, hidden: int, vocab: int, rounds: int = 200) -> dict[str, float]:
    """Median ms of each collective a decode step of ``num_seqs`` rows makes, between two gloo processes."""
    import torch.multiprocessing as mp

    from common.procs import free_port

    shapes = {"all_reduce [rows, hidden]": (num_seqs, hidden),
              "all_gather [rows, vocab/2] (logits)": (num_seqs, vocab // 2),
              "send [rows, hidden] (one pipeline hop)": (num_seqs, hidden)}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_rank, args=(free_port(), shapes, rounds, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="tp1,tp2,pp2", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--model", default=None, help="HF directory (default: a random 8-head Llama, written once)")
    p.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "sluice-bench-parallel-llama"))
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2, help="rounds of all configurations, interleaved")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    model = ns.model or str(write_model(Path(ns.model_dir)))
    steps: dict[str, list[float]] = {name: [] for name in ns.configs.split(",")}
    for _ in range(ns.rounds):
        for name in steps:
            tp, pp = CONFIGS[name]
            steps[name] += decode_steps(model, tp, pp, ns.num_seqs, ns.input_len, ns.output_len, ns.dtype)
    medians = {name: statistics.median(s) for name, s in steps.items()}
    calls = comm(ns.num_seqs, MODEL["hidden_size"], MODEL["vocab_size"])
    layers = MODEL["num_hidden_layers"]
    estimate = {"tp2": (2 * layers + 1) * calls["all_reduce [rows, hidden]"]
                + calls["all_gather [rows, vocab/2] (logits)"],
                "pp2": 3 * calls["send [rows, hidden] (one pipeline hop)"]}
    result: dict[str, Any] = {
        "date": utc_timestamp(), "machine": machine_info(), "model": model, "dtype": ns.dtype,
        "num_seqs": ns.num_seqs, "decode_step_ms_median": medians,
        "ratio_to_tp1": {n: medians[n] / medians["tp1"] for n in medians if "tp1" in medians},
        "collective_ms_median": calls, "communication_ms_per_step_estimate": estimate,
        "command": " ".join(["python -m benchmarks.parallel", *(argv if argv is not None else sys.argv[1:])]),
    }
    print(json.dumps(result, indent=2))
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
