"""Model step time with and without LoRA, in process, on the default model (or --model).

    python -m benchmarks.lora_step --dtype auto --max-loras 4 --rank 16

Drives ``UniprocExecutor.execute_model`` with hand-built steps (no scheduler): a decode step of --decode-rows
sequences spread over --max-loras random rank --rank adapters on all seven projections, and a --prefill-len
prefill of one adapter's request; each against the same step of an engine without LoRA, and the LoRA engine's
step when no row uses an adapter (which should cost nothing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import EngineConfig, LoRAConfig
from engine.core.lora_request import LoRARequest
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.executor.uniproc import UniprocExecutor
from engine.models import ModelConfig
from engine.models.lora import TARGET_MODULES, module_shape

BLOCK = 16


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT-format adapter on all seven projections of every layer."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(TARGET_MODULES)}))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGET_MODULES:
            out_features, in_features = module_shape(module, config)
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{name}.lora_A.weight"] = 0.01 * torch.randn(rank, in_features, generator=gen)
            tensors[f"{name}.lora_B.weight"] = 0.01 * torch.randn(out_features, rank, generator=gen)
    save_file(tensors, str(folder / "adapter_model.safetensors"))


class Steps:
    """Hand-built steps on an executor; KV blocks are handed out round-robin (the values are not checked)."""

    def __init__(self, executor: UniprocExecutor) -> None:
        self.executor = executor
        self.next_block = 0

    def blocks(self, req: Request, num_tokens: int) -> None:
        while len(req.block_ids) * BLOCK < num_tokens:
            req.block_ids.append(self.next_block % self.executor.num_blocks)
            self.next_block += 1

    def run(self, items: list[tuple[Request, int]]) -> float:
        scheduled = []
        for req, n in items:
            self.blocks(req, req.num_computed_tokens + n)
            scheduled.append(ScheduledRequest.of(req, n))
        t0 = time.perf_counter()
        out = self.executor.execute_model(SchedulerOutput(scheduled=scheduled,
                                                          num_batched_tokens=sum(n for _, n in items)))
        elapsed = time.perf_counter() - t0
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.sample:
                s.request.append_output_token(out.sampled[s.request.seq_id][0])
        return elapsed


class Workload:
    """The decode rows (already prefilled) and fresh prefills of one configuration."""

    def __init__(self, executor: UniprocExecutor, loras: list[LoRARequest | None], ns: argparse.Namespace) -> None:
        self.steps = Steps(executor)
        self.loras = loras
        self.ns = ns
        self.params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
        prompt = [100 + j % 1000 for j in range(ns.context)]
        self.rows = [Request(f"d{i}", prompt, self.params, lora_request=loras[i % len(loras)])
                     for i in range(ns.decode_rows)]
        self.steps.run([(r, ns.context) for r in self.rows])
        self.num_prefills = 0

    def decode(self) -> float:
        return self.steps.run([(r, 1) for r in self.rows])

    def prefill(self) -> float:
        self.num_prefills += 1
        req = Request(f"p{self.num_prefills}", [100 + j % 1000 for j in range(self.ns.prefill_len)], self.params,
                      lora_request=self.loras[0])
        return self.steps.run([(req, self.ns.prefill_len)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_step", description=__doc__)
    p.add_argument("--model", default=None, help="HF folder or GGUF file; default: the default model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--decode-rows", type=int, default=32)
    p.add_argument("--context", type=int, default=64, help="prompt tokens of each decode row")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--num-threads", type=int, default=None)
    ns = p.parse_args(argv)
    common = dict(model=ns.model, dtype=ns.dtype, block_size=BLOCK, num_kv_blocks=1024,
                  max_num_batched_tokens=max(2048, ns.prefill_len), num_threads=ns.num_threads)
    plain = UniprocExecutor(EngineConfig(**common))  # type: ignore[arg-type]
    plain.initialize_cache(set())
    tmp = tempfile.TemporaryDirectory()
    loras: list[LoRARequest | None] = []
    for i in range(ns.max_loras):
        write_adapter(Path(tmp.name) / f"a{i}", plain.model_config, ns.rank, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp.name) / f"a{i}")))
    lora_config = LoRAConfig(max_loras=ns.max_loras, max_lora_rank=ns.rank)
    executor = UniprocExecutor(EngineConfig(**common, lora_config=lora_config))  # type: ignore[arg-type]
    executor.initialize_cache(set())
    # The three run in turn, step by step, so that whatever else loads the machine weighs on each alike.
    workloads = {"no_lora": Workload(plain, [None], ns), "lora_engine_base_rows": Workload(executor, [None], ns),
                 "lora": Workload(executor, loras, ns)}
    times: dict[str, dict[str, list[float]]] = {name: {"decode": [], "prefill": []} for name in workloads}
    for rep in range(ns.repeats + 1):
        for name, work in workloads.items():
            decode, prefill = work.decode(), work.prefill()
            if rep:   # the first round warms oneDNN's primitives and the slots
                times[name]["decode"].append(decode)
                times[name]["prefill"].append(prefill)
    tmp.cleanup()
    result: dict[str, object] = {
        name: {f"{kind}_ms": round(1000 * statistics.median(t), 2) for kind, t in kinds.items()}
        for name, kinds in times.items()}
    result["dtype"] = executor.dtype_name
    result["command"] = " ".join(["python -m benchmarks.lora_step", *(argv if argv is not None else sys.argv[1:])])
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
