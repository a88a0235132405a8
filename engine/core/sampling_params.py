"""Per-request sampling and stopping parameters, with vLLM's names and defaults."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from common.errors import InvalidRequestError

_GREEDY_EPS = 1e-5  # below this temperature sampling is greedy (vLLM's _SAMPLING_EPS; the sampler agrees)
# Largest constraint text (a JSON schema as JSON, a regex, a grammar, the choices together) a request may carry:
# compiling is linear in it under llguidance's limits, and 64 KiB holds any hand-written schema.
MAX_CONSTRAINT_BYTES = 64 * 1024
_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's ``StructuredOutputsParams``): exactly one field set.

    ``json``: a JSON schema (dict or JSON text); ``regex``: the whole output matches it; ``choice``: the output
    is one of the strings; ``grammar``: Lark, or GBNF / EBNF with ``::=`` rules; ``json_object``: any JSON
    object. Whether the constraint compiles is checked when the request is added, before it is queued.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in _CONSTRAINT_KINDS
                      if getattr(self, name) is not None and getattr(self, name) is not False]
        _check(len(set_fields) == 1, "structured_outputs",
               f"exactly one of {', '.join(_CONSTRAINT_KINDS)} must be set, got "
               f"{', '.join(set_fields) if set_fields else 'none'}")
        kind = set_fields[0]
        where = f"structured_outputs.{kind}"
        if kind == "json":
            _check(isinstance(self.json, (dict, str)), where, "must be a JSON schema (an object or JSON text)")
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(where, f"is not valid JSON: {e}") from e
                _check(isinstance(schema, (dict, bool)), where, "must be a JSON object")
        elif kind == "choice":
            _check(isinstance(self.choice, list) and bool(self.choice)
                   and all(isinstance(c, str) and c for c in self.choice), where,
                   "must be a non-empty list of non-empty strings")
        elif kind == "json_object":
            _check(self.json_object is True, where, "must be true when set")
        else:
            _check(isinstance(getattr(self, kind), str) and bool(getattr(self, kind)), where,
                   "must be a non-empty string")
        size = len(self.text.encode("utf-8"))
        _check(size <= MAX_CONSTRAINT_BYTES, where, f"is {size} bytes, more than the {MAX_CONSTRAINT_BYTES} allowed")

    @property
    def kind(self) -> str:
        """The field that is set: json, regex, choice, grammar or json_object."""
        return next(name for name in _CONSTRAINT_KINDS
                    if getattr(self, name) is not None and getattr(self, name) is not False)

    @property
    def text(self) -> str:
        """The constraint as one string (the compiled-grammar cache's key). A schema's keys keep their order: the
        order of ``properties`` is the order the output's fields are generated in."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else _json.dumps(self.json)
        if kind == "choice":
            return _json.dumps(self.choice)
        if kind == "json_object":
            return ""
        value = getattr(self, kind)
        assert isinstance(value, str)
        return value


@dataclass(frozen=True)
class ReasoningParams:
    """The output opens with a reasoning model's thinking, which ``end_token_id`` closes (the ``</think>`` token
    of the tokenizer service's reasoning parser): ``structured_outputs`` constrain only what follows the first
    one sampled, as vLLM's do with a reasoning parser; after ``thinking_token_budget`` output tokens without it
    (vLLM's name), it is the only token the sampler may take."""

    end_token_id: int
    thinking_token_budget: int | None = None

    def validate(self, vocab_size: int | None) -> None:
        _check(_int(self.end_token_id) and self.end_token_id >= 0
               and (vocab_size is None or self.end_token_id < vocab_size), "reasoning.end_token_id",
               f"must be a token id of the vocabulary, got {self.end_token_id!r}")
        budget = self.thinking_token_budget
        _check(budget is None or (_int(budget) and budget >= 0), "thinking_token_budget",
               f"must be an integer >= 0, got {budget!r}")


# vLLM < 0.10 spelled it GuidedDecodingParams (SamplingParams.guided_decoding): the same thing.
GuidedDecodingParams = StructuredOutputsParams


EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True)
class BeamSearch:
    """Beam search instead of sampling, with Hugging Face transformers' rules (``generate(num_beams=...)``).

    A finished beam scores ``cumulative_logprob / num_output_tokens ** length_penalty``. ``early_stopping``:
    False stops when no running beam can beat the finished ones judged at the current length; True as soon as
    ``beam_width`` beams finished; "never" when none can beat them at any length up to max_tokens.
    """

    beam_width: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False

    def validate(self) -> None:
        _check(_int(self.beam_width) and self.beam_width >= 1, "beam_search.beam_width",
               f"must be an integer >= 1, got {self.beam_width!r}")
        _check(_finite(self.length_penalty), "beam_search.length_penalty",
               f"must be a finite number, got {self.length_penalty!r}")
        _check(self.early_stopping in (True, False, "never") and not _int(self.early_stopping),
               "beam_search.early_stopping", f"must be True, False or 'never', got {self.early_stopping!r}")


# What beam search cannot honour as Hugging Face does (its processors act on log-softmaxed scores): refused.
_NOT_WITH_BEAMS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                   "logit_bias": None, "logprobs": None, "best_of": None, "allowed_token_ids": None,
                   "bad_words_token_ids": None}


@dataclass
class SamplingParams:
    """What to sample and when to stop, for one request.

    Text-level options (``stop``, ``include_stop_str_in_output``,
    ``skip_special_tokens``) are applied by the detokenizer outside the engine
    core; the core sees only the token-level fields.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's); None: any.
    allowed_token_ids: list[int] | None = None
    # Words the output never contains (vLLM's bad_words): text, which the engine does not read; LLM.generate
    # tokenizes them into bad_words_token_ids as vLLM's update_from_tokenizer does.
    bad_words: list[str] | None = None
    # The tokenized bad words: the sampler never takes the last token of one whose other tokens end the output.
    bad_words_token_ids: list[list[int]] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # Log-probability of every prompt token given the ones before it, with this many top alternatives.
    prompt_logprobs: int | None = None
    # Stream a sequence's tokens in groups of this many (the first token and the last group go out at
    # once); raises the engine's --stream-interval for this request, never lowers it. None: the engine's.
    stream_interval: int | None = None
    # Sample this many sequences, report the n with the highest cumulative logprob when all have ended.
    best_of: int | None = None
    # Beam search instead of sampling (temperature, top_p, top_k, min_p and seed then do not apply); the n
    # best beams are reported when the request ends.
    beam_search: BeamSearch | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name for structured_outputs: moved there on construction (this field is then None).
    guided_decoding: StructuredOutputsParams | None = None
    # A reasoning model's thinking opens the output: the constraint starts after it, a budget may close it.
    reasoning: ReasoningParams | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None, "guided_decoding",
                   "set structured_outputs or its old name guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {_token_id(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise InvalidRequestError("logit_bias", "keys must be token ids and values numbers") from e
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids] or None
        if self.top_k is not None and self.top_k <= 0:
            # vLLM spells "disabled" as 0 or -1; we keep None as the one spelling.
            if self.top_k in (0, -1):
                self.top_k = None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def holds_outputs(self) -> bool:
        """Outputs are held until the request ends, then its n best sequences are reported (best_of, beams)."""
        return self.best_of is not None or self.beam_search is not None

    @property
    def follows_each_token(self) -> bool:
        """A grammar, bad words or a thinking budget decide each token from the ones before it, allowed_token_ids mask
        every token: the sequence samples one token at a time (no speculation, no multi-step passes, no step
        scheduled ahead of its token), so that every token it keeps went through the sampler's masks."""
        return (self.structured_outputs is not None or self.allowed_token_ids is not None
                or self.bad_words_token_ids is not None
                or (self.reasoning is not None and self.reasoning.thinking_token_budget is not None))

    @property
    def num_forked(self) -> int:
        """Sequences its first sample is taken for (the fork); beam search forks its own beams, one at a time."""
        return 1 if self.beam_search is not None else self.best_of or self.n

    def validate(self, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad field.

        ``logprobs`` and ``prompt_logprobs`` are bounded by ``max_logprobs`` (the engine's --max-logprobs) when
        it is given; construction checks only that they are integers >= 0, so an engine can allow more than 20.
        """
        _check(_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(self.top_k is None or (_int(self.top_k) and self.top_k >= 1), "top_k",
               f"must be >= 1 (or 0/-1/None to disable), got {self.top_k!r}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty!r}")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty!r}")
        _check(self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            _check(value is None or (_int(value) and value >= 0), name, f"must be an integer >= 0, got {value!r}")
            _check(value is None or max_logprobs is None or value <= max_logprobs, name,
                   f"must be at most {max_logprobs} (the engine's --max-logprobs), got {value!r}")
        _check(self.stream_interval is None or (_int(self.stream_interval) and self.stream_interval >= 1),
               "stream_interval", f"must be an integer >= 1, got {self.stream_interval!r}")
        _check(self.seed is None or _int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        _check(self.best_of is None or (_int(self.best_of) and self.best_of >= self.n), "best_of",
               f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.beam_search is not None:
            _check(isinstance(self.beam_search, BeamSearch), "beam_search", "must be a BeamSearch")
            self.beam_search.validate()
            _check(self.n <= self.beam_search.beam_width, "n",
                   f"must be <= beam_search.beam_width ({self.beam_search.beam_width}), got {self.n}")
            for name, neutral in _NOT_WITH_BEAMS.items():
                _check(getattr(self, name) in (neutral, {}), name, "is not supported with beam search")
            # Beams are rewritten from their parents each step; per-sequence grammar state is not forked with them.
            _check(self.structured_outputs is None, "structured_outputs", "is not supported with beam search")
            _check(self.reasoning is None or self.reasoning.thinking_token_budget is None, "thinking_token_budget",
                   "is not supported with beam search")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")
        if self.reasoning is not None:
            _check(isinstance(self.reasoning, ReasoningParams), "reasoning", "must be a ReasoningParams")
            self.reasoning.validate(vocab_size)
        _check(self.allowed_token_ids is None or (bool(self.allowed_token_ids)
                                                   and all(_int(t) and t >= 0 for t in self.allowed_token_ids)),
               "allowed_token_ids", "must be a non-empty list of token ids")
        _check(self.bad_words is None or all(isinstance(w, str) for w in self.bad_words), "bad_words",
               "must be a list of strings")
        _check(self.bad_words_token_ids is None or all(bool(ids) and all(_int(t) and t >= 0 for t in ids)
                                                       for ids in self.bad_words_token_ids),
               "bad_words_token_ids", "must be non-empty lists of token ids")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                _check(_finite(bias) and -100 <= bias <= 100, "logit_bias",
                       f"bias for token {tok} must be in [-100, 100], got {bias!r}")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids),
                              ("logit_bias", list(self.logit_bias or {})),
                              ("allowed_token_ids", self.allowed_token_ids or []),
                              ("bad_words_token_ids", [t for seq in self.bad_words_token_ids or [] for t in seq])):
                bad = [t for t in ids if not (_int(t) and 0 <= t < vocab_size)]
                _check(not bad, name, f"token id {bad[:1]} out of range [0, {vocab_size})")

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)  # type: ignore[arg-type]


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_id(key: object) -> int:
    """logit_bias keys arrive as ints, or as decimal strings from JSON; nothing else is a token id."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    raise ValueError(key)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)
