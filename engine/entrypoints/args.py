"""Engine CLI flags with vLLM's names, turned into one EngineConfig."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from common.errors import InvalidRequestError
from engine.config import (
    KV_CACHE_DTYPES,
    EngineConfig,
    StructuredOutputsConfig,
    check_structured_output_backend,
    parse_size,
)


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
    g.add_argument("--structured-outputs-config", default=None,
                   help='JSON, e.g. \'{"backend": "auto", "disable_any_whitespace": false}\'; the backend is '
                        "llguidance (auto, guidance and llguidance all mean it)")
    g.add_argument("--guided-decoding-backend", default=None,
                   help="vLLM's older flag for the structured-output backend: auto, guidance or llguidance")


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    values = {name: getattr(ns, name) for name in EngineConfig.field_names() if hasattr(ns, name)}
    values["structured_outputs_config"] = structured_outputs_config(
        getattr(ns, "structured_outputs_config", None), getattr(ns, "guided_decoding_backend", None))
    return EngineConfig(**values)


def structured_outputs_config(config_json: str | None, guided_decoding_backend: str | None
                              ) -> StructuredOutputsConfig:
    """``--structured-outputs-config`` (JSON) and ``--guided-decoding-backend``; errors name the flag."""
    flag = "--structured-outputs-config"
    values: dict[str, object] = {}
    if config_json is not None:
        try:
            values = json.loads(config_json)
        except ValueError as e:
            raise InvalidRequestError(flag, f"is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise InvalidRequestError(flag, "must be a JSON object")
        unknown = set(values) - {f.name for f in fields(StructuredOutputsConfig)}
        if unknown:
            raise InvalidRequestError(flag, f"unknown key(s) {', '.join(sorted(unknown))}")
        if "backend" in values:
            check_structured_output_backend(values["backend"], f"{flag} backend")
    if guided_decoding_backend is not None:
        check_structured_output_backend(guided_decoding_backend, "--guided-decoding-backend")
        values.setdefault("backend", guided_decoding_backend)
    return StructuredOutputsConfig(**values)  # type: ignore[arg-type]
