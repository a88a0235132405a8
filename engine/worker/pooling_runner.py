"""The pooling runner beside the generation runner: a pooling model (a BERT-family encoder, or a decoder run as an
embedder or sequence classifier), no KV cache, one forward over each scheduled request's whole prompt, pooled into
the request's output rows.

``PoolingExecutor`` stands where an executor does for the engine core (one rank, in the engine process): the
scheduler admits pooling requests as it admits any (continuous batching under the same token budget and seat cap),
each computes its whole prompt in one step and ends with it. Its block pool is accounting only, sized so that a
step's admitted prompts always fit; no cache memory stands behind it.

Encoders attend bidirectionally within each sequence (``engine.models.bert``); a decoder runs the engine's own
Llama-family model (``engine.models.llama``) with ``NoCacheAttention``: causal attention within each sequence.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open

from common.errors import InvalidRequestError
from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.config import EngineConfig
from engine.device import Device, get_device
from engine.models import ModelConfig, resolve_dtype
from engine.models.bert import BertEncoder, EncoderConfig
from engine.models.config import config_from_hf
from engine.models.llama import CausalLM, build_model
from engine.models.loader import iter_safetensors, safetensors_files
from engine.models.modernbert import ModernBertConfig, ModernBertEncoder
from engine.models.pooler import activate, finish_embedding, pool_states
from engine.models.pooling_config import PoolingModelInfo, read_pooling_info
from engine.models.sharding import WHOLE
from engine.models.varlen_attention import VarlenLayout
from engine.models.weight_names import split_fused
from engine.worker.model_runner import PreparedStep, RunnerOutput
from engine.worker.worker import prepare_model

if TYPE_CHECKING:
    from engine.core.lora_request import LoRARequest
    from engine.core.request import SequenceId
    from engine.core.sampling_params import StructuredOutputsParams
    from engine.core.scheduler_output import SchedulerOutput
    from engine.worker.structured_output import GrammarVocabulary

logger = logging.getLogger(__name__)

# Head tensors of a decoder sequence classifier (transformers' ``score``), and tensors an embedder does not use.
_DECODER_HEAD = "score.weight"
_DECODER_UNUSED = ("lm_head.weight",)


class NoCacheAttention(AttentionBackend):
    """Causal attention within each sequence of a flat batch, nothing cached: a decoder run as a pooling model
    computes each prompt once, whole."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if window is not None or softcap is not None:   # refused at load (PoolingModel)
            raise ValueError("sliding-window and soft-capped attention are not supported by the pooling runner")
        layout = meta.derived.get(self)
        if not isinstance(layout, VarlenLayout):   # built by the first layer, shared by the others
            layout = meta.derived[self] = VarlenLayout(meta.query_lens, query.device)
        return layout.attend(query, key, value, causal=True, scale=scale)


class PoolingModel:
    """A loaded pooling model: hidden states of a flat batch, and a classifier's head."""

    def __init__(self, path: str, info: PoolingModelInfo, dtype: torch.dtype, device: Device) -> None:
        """``device``: where the model runs; a decoder's layers pick their kernels from it."""
        self.info = info
        self.dtype = dtype
        self.device = device.torch_device
        cfg = json.loads((Path(path) / "config.json").read_text())
        files = safetensors_files(Path(path))
        names: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    names[name] = file
        num_labels = info.num_labels if info.kind == "classify" else 0
        self.encoder: BertEncoder | ModernBertEncoder | None = None
        self.decoder: CausalLM | None = None
        self.score: torch.Tensor | None = None
        if info.family == "encoder":
            ecfg: EncoderConfig | ModernBertConfig
            encoder: BertEncoder | ModernBertEncoder
            with torch.device("meta"):
                if info.model_type == "modernbert":
                    ecfg = ModernBertConfig.from_hf(cfg, num_labels)
                    encoder = ModernBertEncoder(ecfg)
                else:
                    ecfg = EncoderConfig.from_hf(cfg, num_labels)
                    encoder = BertEncoder(ecfg)
            encoder = encoder.to_empty(device=self.device)
            encoder.load_weights(iter_safetensors(names, lambda _: WHOLE))   # never sharded
            self.encoder = encoder.to(dtype).eval().requires_grad_(False)
            self.encoder.use_kernels(device.kernel_choice(dtype))
            self.model_config = _encoder_model_config(ecfg)
            return
        # the lm_head is not used: tied, so that a checkpoint without one (``Qwen3Model``) loads
        mc = replace(config_from_hf(cfg, None, has_lm_head=False), tie_word_embeddings=True)
        unsupported = ("sliding-window attention" if mc.sliding_window is not None else
                       "soft-capped attention" if mc.attn_logit_softcapping is not None else
                       "multi-head latent attention" if mc.mla is not None else None)
        if unsupported is not None:
            raise InvalidRequestError("model", f"{path}: {unsupported} is not supported by the pooling runner")
        if num_labels and _DECODER_HEAD not in names:
            raise InvalidRequestError("model", f"{path}: a decoder sequence classifier needs {_DECODER_HEAD}")
        decoder = build_model(mc, dtype, self.device)
        body = {n: p for n, p in names.items() if n != _DECODER_HEAD and n not in _DECODER_UNUSED}
        decoder.load_weights(split_fused(iter_safetensors(body, decoder.weight_shard), mc, decoder.weight_shard))
        prepare_model(decoder, device, dtype)
        self.decoder = decoder
        if num_labels:
            with safe_open(str(names[_DECODER_HEAD]), framework="pt") as f:
                self.score = f.get_tensor(_DECODER_HEAD).to(device=self.device, dtype=dtype)
        self.model_config = mc
        self._backend = NoCacheAttention()
        self._no_cache = [torch.empty(0, device=self.device) for _ in range(mc.num_layers)]

    @property
    def max_len(self) -> int:
        return self.model_config.max_position_embeddings

    def hidden_states(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, seq_lens: list[int]
                      ) -> torch.Tensor:
        """[T, hidden] for a flat batch of whole sequences."""
        positions = torch.cat([torch.arange(n, device=self.device) for n in seq_lens])
        if self.encoder is not None:
            hidden: torch.Tensor = self.encoder(input_ids, positions, token_type_ids, seq_lens)
            return hidden
        assert self.decoder is not None
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(slot_mapping=empty, block_tables=empty, seq_lens=empty, query_lens=seq_lens,
                                 seq_lens_host=seq_lens, num_decodes=0, block_size=1, backend=self._backend)
        out = self.decoder(input_ids, positions, self._no_cache, meta)
        assert isinstance(out, torch.Tensor)
        return out

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled states -> [N, num_labels] logits."""
        if self.encoder is not None:
            return self.encoder.classify(rows)
        assert self.score is not None
        return rows @ self.score.T


def _encoder_model_config(ecfg: EncoderConfig | ModernBertConfig) -> ModelConfig:
    """What the engine core reads of a model (vocabulary, context), for an encoder."""
    return ModelConfig(architecture=ecfg.model_type, vocab_size=ecfg.vocab_size, hidden_size=ecfg.hidden_size,
                       intermediate_size=ecfg.intermediate_size, num_layers=ecfg.num_layers,
                       num_heads=ecfg.num_heads, num_kv_heads=ecfg.num_heads,
                       head_dim=ecfg.hidden_size // ecfg.num_heads, rms_norm_eps=ecfg.layer_norm_eps,
                       rope_theta=0.0, max_position_embeddings=ecfg.max_len, tie_word_embeddings=False)


class PoolingExecutor:
    """The engine core's executor for a pooling model (one rank, in process)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.world_size != 1:
            raise InvalidRequestError("runner", "the pooling runner runs one rank: give tensor_parallel_size and "
                                                "pipeline_parallel_size 1")
        if config.lora_config is not None or config.speculative_config is not None:
            raise InvalidRequestError("runner", "LoRA and speculative decoding do not apply to a pooling model")
        self.config = config
        self.info = read_pooling_info(config.model_path, config.convert, config.pooler_config)
        self.device = get_device(config.device, num_threads=config.num_threads, kernels=config.kernels)
        self.device.set_seed(config.seed)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.model = PoolingModel(config.model_path, self.info, self.dtype, self.device)
        self.num_blocks = 0
        self.last_prepare_s = 0.0
        logger.info("pooling model: %s %s (%s pooling, tasks %s)", self.info.family, self.info.model_type,
                    self.info.pooling_type, ", ".join(self.info.tasks))

    @property
    def model_config(self) -> ModelConfig:
        return self.model.model_config

    @property
    def type_vocab_size(self) -> int | None:
        """Segment ids an encoder reads; None: a decoder, which reads none (they are dropped)."""
        return self.model.encoder.config.type_vocab_size if self.model.encoder is not None else None

    @property
    def device_name(self) -> str:
        return self.device.name

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_cache_dtype_name(self) -> str:
        return "none"

    def initialize_cache(self, eos_token_ids: set[int], grammar_vocabulary: GrammarVocabulary | None = None) -> int:
        """No cache: blocks the scheduler counts and nothing holds, enough for any step's admitted prompts (a whole
        budget of tokens, one partial block each, and the longest prompt)."""
        bs = self.config.block_size
        tokens = max(self.config.max_num_batched_tokens, self.config.max_model_len or self.model.max_len)
        self.num_blocks = math.ceil(tokens / bs) + self.config.max_num_seqs + 1
        return self.num_blocks

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        raise InvalidRequestError("structured_outputs", "this is a pooling model: it generates nothing to constrain")

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        raise RuntimeError("a pooling request has one sequence")

    def add_lora(self, lora: LoRARequest) -> None:
        raise InvalidRequestError("lora_request", "LoRA adapters do not apply to a pooling model")

    def remove_lora(self, lora_id: int) -> None:
        """Nothing is ever loaded."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(pooled=self.run(scheduler_output))

    def prepare_model(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        raise RuntimeError("a pooling engine steps synchronously (pooling_engine_config turns async scheduling off)")

    def execute_prepared(self, prepared: PreparedStep) -> RunnerOutput:
        raise RuntimeError("a pooling engine steps synchronously (pooling_engine_config turns async scheduling off)")

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> dict[SequenceId, torch.Tensor]:
        """Each scheduled pooling request's output rows, float32 [rows, row_size] on the host: one forward over
        the step's whole prompts, then each pooled and finished by its task."""
        specs = [(s.request, s.request.pooling) for s in sched.scheduled if s.request.pooling is not None]
        if not specs:
            return {}
        device = self.device.torch_device
        seq_lens = [request.num_prompt_tokens for request, _ in specs]
        ids = np.concatenate([request.prompt_token_ids for request, _ in specs])
        types = np.concatenate([spec.token_type_ids or np.zeros(n, dtype=np.int64)
                                for (_, spec), n in zip(specs, seq_lens)])
        hidden = self.model.hidden_states(torch.from_numpy(ids).to(device=device, dtype=torch.int64),
                                          torch.as_tensor(types, dtype=torch.int64, device=device), seq_lens)
        info = self.info
        pooled = pool_states(hidden, seq_lens, ["ALL" if spec.task == "token_embed" else info.pooling_type
                                                for _, spec in specs])
        scored = [i for i, (_, spec) in enumerate(specs) if spec.task in ("classify", "score")]
        logits = dict(zip(scored, self.model.classify(torch.stack([pooled[i] for i in scored])))) if scored else {}
        out: dict[SequenceId, torch.Tensor] = {}
        for i, (request, spec) in enumerate(specs):
            params = spec.params
            if i in logits:
                use = info.use_activation if params.use_activation is None else params.use_activation
                row = activate(logits[i], info.activation if use else "identity")
            else:
                normalize = info.normalize if params.normalize is None else params.normalize
                dims = params.dimensions if params.dimensions is not None else info.default_dimensions
                row = finish_embedding(pooled[i], normalize=normalize, dimensions=dims)
            out[request.seq_id] = row.reshape(-1, row.shape[-1]).cpu()
        return out

    def release(self, seq_ids: list[SequenceId]) -> None:
        """No per-sequence state."""

    def check_health(self) -> None:
        """The one rank is this process."""

    def encoder_cache_stats(self) -> tuple[int, int]:
        """No vision tower."""
        return 0, 0

    @property
    def kv_source(self) -> None:
        """No KV cache to transfer."""
        return None

    def image_tokens(self, tensors: Mapping[str, Any]) -> int:
        raise ValueError("a pooling model takes no images")

    def shutdown(self) -> None:
        """Nothing to stop."""


def pooling_engine_config(config: EngineConfig) -> EngineConfig:
    """The settings a pooling engine runs under: no prefix cache and no KV offload tier (nothing is cached), no
    async scheduling (each request ends with the step that computed it)."""
    return config.with_changes(enable_prefix_caching=False, kv_offloading_config=None, async_scheduling=False,
                               num_scheduler_steps=1)
