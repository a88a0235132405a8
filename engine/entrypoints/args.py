"""Engine CLI flags with vLLM's names, turned into one EngineConfig."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from pathlib import Path

from common.argtypes import at_least
from common.errors import InvalidRequestError
from common.settings import runtime_lora_updating
from engine.config import (
    KV_CACHE_DTYPES,
    KV_OFFLOADING_BACKENDS,
    LORA_DTYPES,
    PREFIX_CACHING_HASH_ALGOS,
    EngineConfig,
    KVEventsConfig,
    KVOffloadConfig,
    LoRAConfig,
    LoRAModule,
    SpeculativeConfig,
    StructuredOutputsConfig,
    check_structured_output_backend,
    default_max_queued_requests,
    parse_human_int,
    parse_size,
)
from engine.entrypoints.vllm_compat import add_vllm_compat_args
from engine.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config

logger = logging.getLogger(__name__)


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


_positive_int = at_least(1, integer=True)
# vLLM's choices; external_launcher is refused with the reason (vllm_compat).
_EXECUTOR_BACKENDS = ("uni", "mp", "ray", "external_launcher")


def _device_ids(value: str) -> tuple[int, ...]:
    """``--device-ids 0,1,2,3``: distinct integers >= 0."""
    try:
        ids = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of device ids: {value!r}") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"device ids must be distinct integers >= 0, got {value!r}")
    return ids


UNBOUNDED = "unbounded"


def _queue_bound(value: str) -> int | str:
    """``--max-queued-requests``: an integer >= 0, or the word ``unbounded`` (the config's None)."""
    if value.strip().lower() == UNBOUNDED:
        return UNBOUNDED
    try:
        bound = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer >= 0 or {UNBOUNDED!r}: {value!r}") from None
    if bound < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (or {UNBOUNDED!r}), got {bound}")
    return bound


def queue_bound(given: int | str | None, max_num_seqs: int) -> int | None:
    """The config's max_queued_requests from the flag: not given, the servers' bounded default; ``unbounded``,
    None."""
    if given is None:
        return default_max_queued_requests(max_num_seqs)
    return None if given == UNBOUNDED else int(given)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (vLLM's flag names)")
    g.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API (several: the first is the one responses carry, the others "
                        "are aliases clients may send, as vLLM's); default: the model's path")
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
    g.add_argument("--prefix-caching-hash-algo", default="sha256", choices=PREFIX_CACHING_HASH_ALGOS,
                   help="the prefix cache's block hash, vLLM's (docs/serving.md, 'KV cache events'); the cbor "
                        "ones can be recomputed outside Python. Set PYTHONHASHSEED for hashes a router can predict")
    g.add_argument("--data-parallel-rank", "-dpn", type=int, default=0,
                   help="this engine's data-parallel rank (`sluice serve --data-parallel-size N` sets it): KV events "
                        "are stamped with it and bind their ports + rank")
    g.add_argument("--kv-events-config", default=None,
                   help='KV cache events as vLLM publishes them, JSON with vLLM\'s keys: \'{"enable_kv_cache_events": '
                        'true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\'')
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='prefill/decode disaggregation as vLLM takes it: \'{"kv_connector": "SharedMemoryConnector", '
                        '"kv_role": "kv_producer"}\' (kv_consumer, kv_both; MooncakeConnector across hosts). '
                        "docs/serving.md, 'Prefill/decode disaggregation'")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="a KV offload tier of this many GiB: full blocks evicted from the KV cache are kept there "
                        "and loaded back on a prefix miss (docs/serving.md, 'KV offload tiers')")
    g.add_argument("--kv-offloading-backend", default=None, choices=KV_OFFLOADING_BACKENDS,
                   help="native: host memory (default); disk: files in --kv-offloading-path")
    g.add_argument("--kv-offloading-path", default=None, metavar="DIR",
                   help="the directory the disk tier's files go in (required with --kv-offloading-backend disk)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache bytes, e.g. 4GiB or 512MB (g alone: GiB); on accelerators it replaces the "
                        "--gpu-memory-utilization share (default: 2GiB on CPU)")
    g.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory", type=parse_human_int, default=None,
                   help="vLLM's spelling of --kv-cache-memory, with vLLM's units: 4G = 4 GiB, 4g = 4e9 bytes")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--device-memory-utilization", "--gpu-memory-utilization", dest="device_memory_utilization",
                   type=float, default=0.9)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-queued-requests", type=_queue_bound, default=None,
                   help="requests that may wait beyond the free running seats (--max-num-seqs) before new ones "
                        "get 429 / RESOURCE_EXHAUSTED (default: 4 x --max-num-seqs, at least 256: a burst of "
                        "four batches waits, more is sent elsewhere); 'unbounded' for no limit")
    g.add_argument("--max-expected-ttft-ms", type=int, default=None, metavar="MS",
                   help="refuse a new request early (429 + Retry-After / RESOURCE_EXHAUSTED) when its expected wait "
                        "for a first token, from the prefill and seat rates the engine measured, exceeds MS "
                        "milliseconds; admits everything until it has measured them (default: off). Not MindIE's "
                        "maxFirstTokenWaitTime, which preempts running requests for one that waited that long")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--enforce-eager", action="store_true", default=False,
                   help="run every step eagerly: no CUDA or NPU graphs of decode steps are captured (CPU "
                        "always runs eagerly)")
    g.add_argument("--max-seq-len-to-capture", type=int, default=8192,
                   help="decode steps whose longest context exceeds this run eagerly")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA or NPU graphs (default 1 2 4 8 16 24 32 ... 512, "
                        "up to --max-num-seqs); a step runs the smallest one that holds it")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and prepare step N + 1 while step N runs (default: on where it helps; "
                        "outputs are the same either way)")
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode passes per step (multi-step scheduling): each decode runs up to N forward "
                        "passes per schedule, never past max_tokens or max_model_len; tokens after a stop are "
                        "dropped")
    g.add_argument("--multi-step-stream-outputs", type=_bool_value, nargs="?", const=True, default=True,
                   metavar="BOOL", help="with --num-scheduler-steps N: stream each token as its step ends (true, "
                                        "the default) or the N tokens together (false)")
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
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="default sampling parameters of requests that set none: the model's generation_config.json "
                        "(auto), vLLM's own (vllm), or a folder's generation_config.json")
    g.add_argument("--disable-sliding-window", action="store_true", default=False,
                   help="sliding-window models: full attention in every layer, the context capped at the window "
                        "(vLLM's flag)")
    pool = parser.add_argument_group("pooling models (vLLM's flag names; docs/models.md)")
    pool.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                      help="pooling: embeddings, scores, classification (auto: pooling for encoders and "
                           "*ForSequenceClassification)")
    pool.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify"],
                      help="embed: a generation model as an embedder (last-token pooling); classify: its "
                           "*ForSequenceClassification head")
    pool.add_argument("--pooler-config", default=None, metavar="JSON",
                      help='e.g. {"pooling_type": "MEAN", "normalize": true}')
    par = parser.add_argument_group("parallelism (vLLM's flag names; docs/distributed.md)")
    par.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                     help="ranks each layer is split over (attention heads, MLP columns, vocabulary)")
    par.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1,
                     help="stages the layers are split into, one rank group each")
    par.add_argument("--enable-expert-parallel", action="store_true", default=False,
                     help="mixture-of-experts layers: each tensor-parallel rank holds whole experts, its share of "
                          "them, instead of a slice of every expert (a dense model has none: no effect)")
    par.add_argument("--distributed-executor-backend", default=None, choices=_EXECUTOR_BACKENDS,
                     help="how the ranks run: uni (in the engine process; one rank only), mp (a process per rank, "
                          "the default for more than one), ray (a Ray actor per rank, across hosts: RAY_ADDRESS "
                          "joins a cluster, else a local one starts)")
    par.add_argument("--device-ids", type=_device_ids, default=None, metavar="ID,ID,...",
                     help="accelerator ids of the ranks in rank order (default: 0, 1, ...; MindIE's npuDeviceIds)")
    par.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                     help="engine replicas behind the gateways (sluice serve only: one engine is one replica)")
    spec = parser.add_argument_group("speculative decoding (vLLM's flag names)")
    spec.add_argument("--speculative-config", "-sc", default=None,
                      help='JSON: \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' or '
                           '\'{"model": DRAFT_MODEL, "num_speculative_tokens": 3}\'; or its keys one by one, as '
                           "vLLM takes them: --speculative-config.num_speculative_tokens 3 "
                           "(docs/speculative-decoding.md)")
    spec.add_argument("--spec-method", default=None, help="--speculative-config's method: ngram or draft_model")
    spec.add_argument("--spec-model", default=None, help="--speculative-config's draft model (HF directory or "
                                                         ".gguf file)")
    spec.add_argument("--spec-tokens", type=int, default=None,
                      help="--speculative-config's num_speculative_tokens: tokens proposed per step")
    lora = parser.add_argument_group("LoRA adapters (vLLM's flag names)")
    lora.add_argument("--enable-lora", action="store_true", default=False,
                      help="serve LoRA adapters next to the base model; requests pick one by its name as `model`")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help='adapters served from start-up: name=path, or JSON {"name": ..., "path": ..., '
                           '"base_model_name": ...}; a path is a PEFT folder (adapter_config.json + '
                           "adapter_model.safetensors)")
    lora.add_argument("--max-loras", type=int, default=None, help="adapters one step may mix (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept loaded in host memory (default: --max-loras); others reload on use")
    lora.add_argument("--lora-dtype", default=None, choices=LORA_DTYPES,
                      help="dtype of the adapters' weights (default auto: the model's)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true", default=None,
                      help="let clients load and unload adapters (POST /v1/load_lora_adapter, "
                           "/v1/unload_lora_adapter); also VLLM_ALLOW_RUNTIME_LORA_UPDATING=true")
    lora.add_argument("--fully-sharded-loras", action="store_true", default=False,
                      help="vLLM's switch to shard LoRA computation across tensor-parallel ranks: LoRA runs at "
                           "tensor-parallel size 1 only, with nothing to shard")
    lora.add_argument("--enable-lora-bias", action="store_true", default=False,
                      help="refused: adapters with bias weights are not supported")
    lora.add_argument("--long-lora-scaling-factors", default=None, help="refused: LongLoRA is not supported")
    add_vllm_compat_args(parser)


def _bool_value(value: str) -> bool:
    """vLLM's spelling of a boolean flag's value: true/false (any case), 1/0, yes/no."""
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    values = {name: getattr(ns, name) for name in EngineConfig.field_names() if hasattr(ns, name)}
    values["max_queued_requests"] = queue_bound(values.get("max_queued_requests"),
                                                values.get("max_num_seqs", EngineConfig.max_num_seqs))
    values["structured_outputs_config"] = structured_outputs_config(
        getattr(ns, "structured_outputs_config", None), getattr(ns, "guided_decoding_backend", None))
    values["lora_config"] = lora_config(ns)
    values["speculative_config"] = speculative_config(ns)
    given = getattr(ns, "kv_events_config", None)
    values["kv_events_config"] = (None if given is None
                                  else kv_events_config(json_object(given, "--kv-events-config")))
    values["num_kv_blocks"] = kv_blocks(ns)
    values["kv_offloading_config"] = kv_offloading_config(ns)
    values["kv_transfer_config"] = kv_transfer_config(ns)
    if values.get("quantization") == "gguf":   # what a GGUF file always runs (vllm_compat notes it)
        values["quantization"] = None
    if isinstance(values.get("cuda_graph_sizes"), list):
        values["cuda_graph_sizes"] = tuple(values["cuda_graph_sizes"])
    if isinstance(values.get("served_model_name"), list):
        values["served_model_name"] = values["served_model_name"][0]
    return EngineConfig(**values)


def kv_blocks(ns: argparse.Namespace) -> int | None:
    """``--num-kv-blocks``, or vLLM's ``--num-gpu-blocks-override`` (the same setting); both given must agree."""
    ours, vllms = getattr(ns, "num_kv_blocks", None), getattr(ns, "num_gpu_blocks_override", None)
    if ours is not None and vllms is not None and ours != vllms:
        raise InvalidRequestError("--num-gpu-blocks-override", f"{vllms} contradicts --num-kv-blocks {ours}")
    return ours if ours is not None else vllms


_LORA_FLAGS = ("lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype",
               "allow_runtime_lora_updating")


def lora_config(ns: argparse.Namespace) -> LoRAConfig | None:
    """``--enable-lora`` and its companions; None when LoRA is off. Errors name the flag."""
    if getattr(ns, "enable_lora_bias", False):
        raise InvalidRequestError("--enable-lora-bias", "LoRA bias weights are not supported (adapters whose "
                                                        "adapter_config.json has a bias other than \"none\" are "
                                                        "refused)")
    if getattr(ns, "long_lora_scaling_factors", None) is not None:
        raise InvalidRequestError("--long-lora-scaling-factors", "LongLoRA is not supported")
    given = {name: getattr(ns, name) for name in _LORA_FLAGS if getattr(ns, name, None) is not None}
    if not getattr(ns, "enable_lora", False):
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise InvalidRequestError(flag, "needs --enable-lora")
        return None
    if getattr(ns, "fully_sharded_loras", False):
        logger.info("--fully-sharded-loras: at tensor-parallel size 1 each adapter is whole on the one worker")
    if "allow_runtime_lora_updating" not in given and runtime_lora_updating():
        given["allow_runtime_lora_updating"] = True
    if "lora_modules" in given:
        given["lora_modules"] = tuple(parse_lora_module(text) for text in given["lora_modules"])
    return LoRAConfig(**given)


def parse_lora_module(text: str) -> LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form."""
    flag = "--lora-modules"
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise InvalidRequestError(flag, f"{text!r} is not valid JSON: {e}") from e
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
                value.get("path"), str):
            raise InvalidRequestError(flag, f"{text!r}: the JSON form needs string \"name\" and \"path\"")
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise InvalidRequestError(flag, f"{text!r}: unknown key(s) {', '.join(sorted(unknown))}")
        base = value.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise InvalidRequestError(flag, f"{text!r}: base_model_name must be a string")
        name, path = value["name"], value["path"]
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise InvalidRequestError(flag, f"{text!r} is not name=path (or the JSON form)")
    if not name or not path:
        raise InvalidRequestError(flag, f"{text!r}: the name and the path must not be empty")
    return LoRAModule(name=name, path=path, base_model_name=base)


# vLLM's shorthand flags for --speculative-config keys.
_SPEC_SHORTHANDS = (("--spec-method", "spec_method", "method"), ("--spec-model", "spec_model", "model"),
                    ("--spec-tokens", "spec_tokens", "num_speculative_tokens"))


def speculative_config(ns: argparse.Namespace) -> SpeculativeConfig | None:
    """``--speculative-config`` (JSON) with vLLM's shorthands ``--spec-method``, ``--spec-model``,
    ``--spec-tokens``; None when none is given. Errors name the flag, and the key as vLLM's dotted flag
    (``--speculative-config.method``)."""
    flag = "--speculative-config"
    given = getattr(ns, "speculative_config", None)
    values: dict[str, object] | None = None
    if given is not None:
        values = {key.replace("-", "_"): value   # vLLM reads both spellings
                  for key, value in json_object(given, flag).items()}
    for shorthand, dest, key in _SPEC_SHORTHANDS:
        value = getattr(ns, dest, None)
        if value is None:
            continue
        values = {} if values is None else values
        if key in values:
            raise InvalidRequestError(shorthand, f"sets {key!r}, which {flag} sets too: give it once")
        values[key] = value
    if values is None:
        return None
    try:
        return SpeculativeConfig.from_dict(values)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.field.replace("speculative_config", flag, 1), e.message) from e


def check_local_paths(config: EngineConfig) -> None:
    """Paths a command line names that must exist before any process starts (a draft model that is missing
    would otherwise fail the engine at every restart)."""
    spec = config.speculative_config
    if spec is not None and spec.model is not None and not Path(spec.model).exists():
        raise InvalidRequestError("--speculative-config.model", f"{spec.model!r} does not exist: the draft model "
                                                                "is a local HF directory or .gguf file")
    if config.model is not None:   # a quantization the loader would refuse (3-bit GPTQ, an unknown quant_method)
        from engine.models.int4_checkpoint import check_checkpoint

        check_checkpoint(config.model, config.quantization, config.device)


def kv_events_config(values: dict[str, object]) -> KVEventsConfig:
    """``--kv-events-config``'s JSON object; errors name the flag and the key."""
    try:
        return KVEventsConfig.from_dict(values)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.field.replace("kv_events_config", "--kv-events-config", 1), e.message) from e
    except TypeError as e:   # a value of the wrong type
        raise InvalidRequestError("--kv-events-config", str(e)) from e


def kv_transfer_config(ns: argparse.Namespace) -> KVTransferConfig | None:
    """``--kv-transfer-config``'s JSON object; None without it. Errors name the flag and the key."""
    given = getattr(ns, "kv_transfer_config", None)
    if given is None:
        return None
    try:
        return parse_kv_transfer_config(given)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.field.replace("kv_transfer_config", "--kv-transfer-config", 1), e.message) from e


def kv_offloading_config(ns: argparse.Namespace) -> KVOffloadConfig | None:
    """``--kv-offloading-size`` / ``-backend`` / ``-path``; None without a size. Errors name the flag."""
    size, backend = getattr(ns, "kv_offloading_size", None), getattr(ns, "kv_offloading_backend", None)
    path = getattr(ns, "kv_offloading_path", None)
    if size is None:
        given = "--kv-offloading-backend" if backend is not None else "--kv-offloading-path" if path else None
        if given is not None:
            raise InvalidRequestError(given, "needs --kv-offloading-size (the tier's GiB)")
        return None
    try:
        return KVOffloadConfig(size, backend or "native", path)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"--{e.field.replace('_', '-')}", e.message) from e


def json_object(text: str, flag: str) -> dict[str, object]:
    """A flag's JSON object; InvalidRequestError naming the flag when it is not one."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(flag, f"is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise InvalidRequestError(flag, f"must be a JSON object, got {text!r}")
    return value


def structured_outputs_config(config_json: str | None, guided_decoding_backend: str | None
                              ) -> StructuredOutputsConfig:
    """``--structured-outputs-config`` (JSON) and ``--guided-decoding-backend``; errors name the flag."""
    flag = "--structured-outputs-config"
    values: dict[str, object] = {}
    if config_json is not None:
        values = json_object(config_json, flag)
        unknown = set(values) - {f.name for f in fields(StructuredOutputsConfig)}
        if unknown:
            raise InvalidRequestError(flag, f"unknown key(s) {', '.join(sorted(unknown))}")
        if "backend" in values:
            check_structured_output_backend(values["backend"], f"{flag} backend")
    if guided_decoding_backend is not None:
        check_structured_output_backend(guided_decoding_backend, "--guided-decoding-backend")
        values.setdefault("backend", guided_decoding_backend)
    return StructuredOutputsConfig(**values)  # type: ignore[arg-type]
