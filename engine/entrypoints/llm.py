"""The offline API users know from vLLM: ``LLM(model).generate(prompts, SamplingParams(...))``.

It joins the engine core (token ids only) to the text library: prompts are
tokenized here, outputs detokenized incrementally, stop strings matched here
and turned into an abort of the engine request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The offline API is an entry point: OpenMP's defaults are set before the imports below load torch.
from engine.entrypoints.generation_config import generation_defaults, log_defaults
from engine.entrypoints.process import set_openmp_defaults

set_openmp_defaults()

from common.errors import InvalidRequestError  # noqa: E402
from engine.config import EngineConfig, KVEventsConfig, LoRAConfig, SpeculativeConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.core.finish_reason import FinishReason  # noqa: E402
from engine.core.lora_request import LoRARequest  # noqa: E402
from engine.core.multimodal import MultiModalItem  # noqa: E402
from engine.core.outputs import (  # noqa: E402
    CompletionOutput,
    EngineCoreOutput,
    PromptLogprobDicts,
    RequestOutput,
    SampleLogprobs,
)
from engine.core.pooling_params import PoolingParams  # noqa: E402
from engine.core.request import SequenceId  # noqa: E402
from engine.core.sampling_params import (  # noqa: E402
    BeamSearch,
    EarlyStopping,
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from engine.entrypoints import offline_multimodal, pooling_outputs  # noqa: E402
from engine.entrypoints.draft_check import check_draft_tokenizer  # noqa: E402
from engine.entrypoints.offline_logprobs import prompt_logprob_dicts, token_logprobs  # noqa: E402
from engine.entrypoints.pooling_outputs import (  # noqa: E402
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingPrompt,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from engine.kv_transfer_config import parse_kv_transfer_config  # noqa: E402
from engine.text import IncrementalDetokenizer, Tokenizer  # noqa: E402
from engine.text.bad_words import bad_words_token_ids  # noqa: E402
from engine.worker.structured_output import GrammarVocabulary  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "LoRARequest", "PoolingParams"]

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
Message = dict[str, Any]
# One adapter for every prompt, or one (None: the base model) per prompt, as vLLM's ``lora_request``.
LoRARequestArg = LoRARequest | Sequence[LoRARequest | None] | None

# vLLM's LLM keyword arguments for LoRA → LoRAConfig's fields (enable_lora turns it on).
_LORA_KWARGS = ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype")

_FINISH_NAMES = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                 FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}


@dataclass
class _Sequence:
    """One of the n outputs of one prompt, as the offline API tracks it."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's offline beam search parameters (``LLM.beam_search``); the search follows transformers' rules."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False


@dataclass
class BeamSearchSequence:
    """One returned beam: ``tokens`` holds the prompt's ids then the beam's (vLLM's layout); ``text`` the beam's."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class LLM:
    """An engine in this process. ``model=None`` serves the default model (SmolLM2-135M-Instruct GGUF).

    Engine arguments use vLLM's names: ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``block_size``, ``dtype``, ``enable_prefix_caching``, ``seed``, ``kv_cache_memory``… LoRA: ``enable_lora=True``
    with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, ``lora_dtype``; requests then name their adapter
    with ``lora_request=LoRARequest(name, id, path)``. Speculative decoding: ``speculative_config={"method":
    "ngram", "num_speculative_tokens": 3}`` or ``{"model": DRAFT_PATH, "num_speculative_tokens": 3}`` (vLLM's
    keys, as ``--speculative-config``), or a SpeculativeConfig.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, enable_lora: bool = False,
                 speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
                 **engine_args: Any) -> None:
        lora_args = {name: engine_args.pop(name) for name in _LORA_KWARGS if name in engine_args}
        unknown = set(engine_args) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        if enable_lora or lora_args:
            engine_args["lora_config"] = _lora_config(enable_lora, lora_args, engine_args.get("lora_config"))
        if isinstance(engine_args.get("kv_events_config"), Mapping):   # vLLM's keys, as --kv-events-config
            engine_args["kv_events_config"] = KVEventsConfig.from_dict(engine_args["kv_events_config"])
        if isinstance(engine_args.get("kv_transfer_config"), (Mapping, str)):   # vLLM's keys, as --kv-transfer-config
            engine_args["kv_transfer_config"] = parse_kv_transfer_config(engine_args["kv_transfer_config"])
        self.config = EngineConfig(model=model, tokenizer=tokenizer,
                                   speculative_config=_speculative_config(speculative_config), **engine_args)
        if self.config.lora_config is not None and self.config.lora_config.lora_modules:
            raise InvalidRequestError("lora_modules", "the offline LLM takes its adapters per request "
                                                      "(lora_request=LoRARequest(name, id, path)), not by name")
        self.tokenizer = Tokenizer.from_pretrained(self.config.tokenizer or self.config.model_path)
        check_draft_tokenizer(self.config, self.tokenizer)
        self.sampling_defaults = generation_defaults(self.config.generation_config, self.config.model_path)
        log_defaults(self.sampling_defaults, self.config.generation_config)
        # The core never reads text: the vocabulary structured outputs mask with is handed to it from here.
        self.engine = EngineCore(self.config, grammar_vocabulary=GrammarVocabulary.from_tokenizer(self.tokenizer))
        # A vision-language model's own processor, for prompts with images (None: a text-only model)
        self.mm_processor = offline_multimodal.load_processor(self.config.model_path,
                                                              self.engine.model_config.image_token_id,
                                                              self.config.limit_mm_per_prompt)
        # A replica's other ranks (mp, ray) stop with this LLM: at close(), when it is collected, or at exit.
        self._close = weakref.finalize(self, self.engine.close)
        self._ids = itertools.count()
        self._built_on = threading.current_thread()
        self._warned_thread = False

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's ``LLM.reset_prefix_cache``); False while a request holds blocks. With KV
        events on, subscribers get AllBlocksCleared."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Stops the engine's other ranks (tensor / pipeline parallel); idempotent. Also done when the LLM is
        garbage-collected and at interpreter exit."""
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API ---------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequestArg = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt_token_ids": [...]}``); outputs in prompt order.

        ``priority``: one per prompt, lower runs earlier; needs ``scheduling_policy="priority"`` (as vLLM).
        ``lora_request``: the adapter for every prompt, or a list with one per prompt (None: the base model);
        needs ``enable_lora=True``. A prompt dict's ``"cache_salt"`` salts its prefix cache, as vLLM's; its
        ``"multi_modal_data"`` (``{"image": PIL image or a list}``, a vision-language model's) goes with its
        ``"prompt"`` through the model's processor."""
        items = self._normalize_prompts(prompts)
        mm = self._process_images(prompts, items)
        params = self._broadcast_params(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise InvalidRequestError("priority", f"got {len(priority)} priorities for {len(items)} prompts")
        return self._run(items, params, priority, _broadcast_loras(lora_request, len(items)), _cache_salts(prompts),
                         mm)

    # -- pooling models (engine.entrypoints.pooling_outputs) -------------------------------------------------
    def embed(self, prompts: PoolingPrompt | Sequence[PoolingPrompt], *,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``)."""
        return pooling_outputs.embed(self._pooling, prompts, pooling_params, truncate_prompt_tokens)

    def classify(self, prompts: PoolingPrompt | Sequence[PoolingPrompt], *,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = False
                 ) -> list[ClassificationRequestOutput]:
        """One score per label per prompt (vLLM's ``LLM.classify``; softmax unless use_activation is False)."""
        return pooling_outputs.classify(self._pooling, prompts, pooling_params, truncate_prompt_tokens)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """Relevance of each pair (vLLM's ``LLM.score``): a cross-encoder's score, or the embeddings' cosine."""
        return pooling_outputs.score(self._pooling, text_1, text_2, pooling_params, truncate_prompt_tokens)

    def encode(self, prompts: PoolingPrompt | Sequence[PoolingPrompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = False) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The raw pooled tensor per prompt (vLLM's ``LLM.encode``; ``pooling_task`` "token_embed": one row per
        token)."""
        return pooling_outputs.encode(self._pooling, prompts, pooling_params, pooling_task, truncate_prompt_tokens)

    @property
    def _pooling(self) -> pooling_outputs.PoolingRunner:
        self._check_thread()
        return pooling_outputs.PoolingRunner(self)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *,
                    lora_request: LoRARequestArg = None) -> list[BeamSearchOutput]:
        """Beam search for every prompt: its ``beam_width`` best beams (by length-penalised score), best first."""
        items = self._normalize_prompts(prompts)
        sp = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            beam_search=BeamSearch(params.beam_width, params.length_penalty, params.early_stopping))
        results = self._run(items, [sp] * len(items), None, _broadcast_loras(lora_request, len(items)))
        return [BeamSearchOutput([BeamSearchSequence(r.prompt_token_ids + c.token_ids, c.text,
                                                     c.cumulative_logprob or 0.0, c.finish_reason)
                                  for c in r.outputs]) for r in results]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequestArg = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate; ``lora_request``
        as for :meth:`generate`, one per conversation when a list."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        items: list[tuple[str | None, list[int]]] = []
        mm: list[tuple[MultiModalItem, ...]] = []
        for conv in conversations:
            if offline_multimodal.has_image_parts(conv):   # image_url parts: through the model's processor
                if self.mm_processor is None:
                    raise offline_multimodal.text_only_refusal(self.config.model_name)
                processed = self.mm_processor.process_chat(conv, add_generation_prompt=add_generation_prompt,
                                                           chat_template=chat_template)
                items.append((processed.prompt, processed.prompt_token_ids))
                mm.append(offline_multimodal.engine_items(processed))
                continue
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template)
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
            mm.append(())
        params = self._broadcast_params(sampling_params, len(items))
        return self._run(items, params, None, _broadcast_loras(lora_request, len(items)), (),
                         mm if any(mm) else None)

    # -- internals ----------------------------------------------------------------------------------------
    def _normalize_prompts(self, prompts: PromptType | Sequence[PromptType]) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]
        items: list[tuple[str | None, list[int]]] = []
        for p in prompts:  # type: ignore[union-attr]
            if isinstance(p, str):
                items.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                items.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
            elif isinstance(p, dict) and "prompt" in p:
                items.append((p["prompt"], self.tokenizer.encode(p["prompt"])))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                items.append((None, list(p)))
            else:
                raise InvalidRequestError("prompt", f"unsupported prompt type {type(p).__name__}")
        return items

    def _process_images(self, prompts: PromptType | Sequence[PromptType], items: list[tuple[str | None, list[int]]]
                        ) -> list[tuple[MultiModalItem, ...]] | None:
        """Each prompt dict's ``multi_modal_data`` through the model's processor: its item in ``items`` becomes the
        processor's ids (placeholders expanded); returns each prompt's images (None: no prompt has any)."""
        seq = [prompts] if isinstance(prompts, dict) else prompts if isinstance(prompts, (list, tuple)) else []
        found = [offline_multimodal.prompt_images(p) for p in seq] if len(seq) == len(items) else []
        if not any(found):
            return None
        if self.mm_processor is None:
            raise offline_multimodal.text_only_refusal(self.config.model_name)
        mm: list[tuple[MultiModalItem, ...]] = []
        for i, (p, images) in enumerate(zip(seq, found)):
            if not images:
                mm.append(())
                continue
            assert isinstance(p, dict)
            if not isinstance(p.get("prompt"), str):
                raise InvalidRequestError("prompt", "a prompt with multi_modal_data needs its text as \"prompt\" "
                                                    "(the processor expands its image placeholders)")
            processed = self.mm_processor.process(p["prompt"], images)
            items[i] = (processed.prompt, processed.prompt_token_ids)
            mm.append(offline_multimodal.engine_items(processed))
        return mm

    def _check_thread(self) -> None:
        """Warn once when steps run on another thread than the one that loaded the model while that one lives:
        on CPU, libgomp then keeps two worker pools, stops spinning at barriers, and steps slow down."""
        here = threading.current_thread()
        if self._warned_thread or here is self._built_on or not self._built_on.is_alive():
            return
        if self.engine.executor.device_name != "cpu":
            return
        self._warned_thread = True
        logger.warning("LLM.generate runs on thread %r but the model was loaded on %r, which is still alive: "
                       "OpenMP keeps a thread pool for each, and its workers stop spinning between parallel "
                       "regions, which slows every step. Build the LLM on the thread that calls generate.",
                       here.name, self._built_on.name)

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters of a call that passes none: the model's generation_config.json defaults
        (``generation_config="auto"``, the default), or vLLM's own (``"vllm"``)."""
        return SamplingParams(**self.sampling_defaults)

    def _broadcast_params(self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [self._with_bad_words(sp)] * n
        if len(sp) != n:
            raise InvalidRequestError("sampling_params", f"got {len(sp)} for {n} prompts")
        return [self._with_bad_words(p) for p in sp]

    def _with_bad_words(self, sp: SamplingParams) -> SamplingParams:
        """``bad_words`` tokenized into ``bad_words_token_ids`` (vLLM's ``update_from_tokenizer``): the engine reads
        token ids only."""
        if not sp.bad_words or sp.bad_words_token_ids is not None:
            return sp
        return sp.clone(bad_words_token_ids=bad_words_token_ids(
            sp.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False)))

    def _run(self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             priority: Sequence[int] | None, loras: Sequence[LoRARequest | None],
             salts: Sequence[str | None] = (), mm: Sequence[tuple[MultiModalItem, ...]] | None = None
             ) -> list[RequestOutput]:
        engine = self.engine
        self._check_thread()
        rids: list[str] = []
        try:
            for i, ((_, ids), sp) in enumerate(zip(items, params)):
                rid = str(next(self._ids))
                engine.add_request(rid, ids, sp, priority=priority[i] if priority else 0, lora_request=loras[i],
                                   cache_salt=salts[i] if salts else None, mm_items=mm[i] if mm else ())
                rids.append(rid)
        except BaseException:
            engine.abort_requests(rids)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        slot = {rid: i for i, rid in enumerate(rids)}
        seqs: dict[SequenceId, _Sequence] = {}
        prompt_logprobs: list[PromptLogprobDicts | None] = [None] * len(rids)
        remaining = len(rids)
        while remaining:
            for out in engine.step():
                i = slot[out.request_id]
                if out.prompt_logprobs is not None and prompt_logprobs[i] is None:
                    prompt_logprobs[i] = prompt_logprob_dicts(out.prompt_logprobs, self._decode_token)
                seq = seqs.get(out.seq_id)
                if seq is None:
                    seq = seqs[out.seq_id] = self._new_sequence(out.index, items[i][1], params[i])
                if seq.finish_reason is None:  # else ended here by a stop string: this is the engine's abort echo
                    self._apply(seq, out, params[i])
                remaining -= out.request_finished
        outputs = []
        for i, rid in enumerate(rids):
            mine = sorted((s for k, s in seqs.items() if k.request_id == rid), key=lambda s: s.index)
            outputs.append(RequestOutput(
                request_id=rid, prompt=items[i][0], prompt_token_ids=items[i][1],
                outputs=[CompletionOutput(index=s.index, text=s.text, token_ids=s.token_ids,
                                          finish_reason=s.finish_reason, logprobs=s.logprobs,
                                          cumulative_logprob=s.cumulative_logprob, stop_reason=s.stop_reason)
                         for s in mine],
                prompt_logprobs=prompt_logprobs[i]))
        return outputs

    def _new_sequence(self, index: int, prompt_ids: list[int], sp: SamplingParams) -> _Sequence:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=sp.skip_special_tokens,
                                       stop=sp.stop, include_stop_str_in_output=sp.include_stop_str_in_output)
        seq = _Sequence(index, detok)
        if sp.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        return seq

    def _decode_token(self, token_id: int) -> str:
        """A token's text alone, special tokens kept: vLLM's ``Logprob.decoded_token``."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _apply(self, seq: _Sequence, out: EngineCoreOutput, sp: SamplingParams) -> None:
        """Fold one engine output into a sequence; a stop string ends it and aborts it in the engine."""
        before = seq.detok.num_output_tokens
        delta = seq.detok.add_tokens(out.new_token_ids) if out.new_token_ids else None
        # Under a stream interval one output holds several tokens; those after a stop string are dropped.
        used = seq.detok.num_output_tokens - before
        seq.token_ids.extend(out.new_token_ids[:used])
        if seq.logprobs is not None and out.new_logprobs:
            for token_id, (lp, top, rank) in zip(out.new_token_ids, out.new_logprobs[:used]):
                seq.logprobs.append(token_logprobs(token_id, lp, rank, top, self._decode_token))
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lp
        if out.cumulative_logprob is not None:   # the engine's sum (best_of and beams report no logprobs)
            seq.cumulative_logprob = out.cumulative_logprob
        if delta is not None and delta.stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", delta.stop_string
            seq.text = seq.detok.output_text
            if not out.finished:
                self.engine.abort_requests([out.seq_id])
            return
        if out.finish_reason is None:
            return
        seq.detok.finish()
        seq.text = seq.detok.output_text
        if seq.detok.stop_string is not None:  # the stop string completed in the final flush
            seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_string
            return
        seq.finish_reason = _FINISH_NAMES[out.finish_reason]
        if out.finish_reason is FinishReason.STOP and out.new_token_ids:
            seq.stop_reason = out.new_token_ids[-1]


def _lora_config(enable_lora: bool, lora_args: dict[str, Any], given: object) -> LoRAConfig:
    """The LoRAConfig of vLLM's LLM keyword arguments; errors name the argument."""
    if not enable_lora:
        raise InvalidRequestError(next(iter(lora_args)), "needs enable_lora=True")
    if given is not None:
        raise InvalidRequestError("lora_config", "give either lora_config or enable_lora with its arguments")
    return LoRAConfig(**lora_args)


def _speculative_config(given: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config`` dict (its keys validated as ``--speculative-config``'s), or one built."""
    if given is None or isinstance(given, SpeculativeConfig):
        return given
    if isinstance(given, Mapping):
        return SpeculativeConfig.from_dict(given)
    raise InvalidRequestError("speculative_config", f"expected a dict of vLLM's keys or a SpeculativeConfig, got "
                                                    f"{type(given).__name__}")


def _cache_salts(prompts: PromptType | Sequence[PromptType]) -> list[str | None]:
    """Each prompt's ``"cache_salt"`` (vLLM's prompt-dict key; None for other prompts); empty when none has one."""
    seq = [prompts] if isinstance(prompts, dict) else prompts if isinstance(prompts, (list, tuple)) else []
    salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in seq]
    return salts if any(s is not None for s in salts) else []


def _broadcast_loras(lora_request: LoRARequestArg, n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of one per prompt (vLLM's semantics)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise InvalidRequestError("lora_request", f"got {len(loras)} LoRA requests for {n} prompts")
    for lora in loras:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise InvalidRequestError("lora_request", f"expected a LoRARequest or None, got {type(lora).__name__}")
    return loras
