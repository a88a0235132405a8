"""Engine CLI flags with vLLM's names, turned into one EngineConfig."""

from __future__ import annotations

import argparse

from engine.config import KV_CACHE_DTYPES, EngineConfig, parse_size


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (vLLM's flag names)")
    g.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=KV_CACHE_DTYPES,
                   help="dtype of the KV cache; auto = the model's (--dtype). float16 halves its memory")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV cache bytes on CPU, e.g. 4GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--device-memory-utilization", "--gpu-memory-utilization", dest="device_memory_utilization",
                   type=float, default=0.9)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-queued-requests", type=int, default=None)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--enforce-eager", action="store_true", default=True)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads on CPU")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="stream each sequence's tokens in groups of N (the first token and the last group at "
                        "once): fewer messages through every hop for less smooth streaming; a request's "
                        "stream_interval can raise it")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most log probabilities a request may ask for (logprobs and prompt_logprobs); more is "
                        "refused")
    g.add_argument("--disable-log-stats", action="store_true", default=False,
                   help="no periodic 'Avg prompt throughput ...' status line")


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    values = {name: getattr(ns, name) for name in EngineConfig.field_names() if hasattr(ns, name)}
    return EngineConfig(**values)
