"""Per-request sampling and stopping parameters, with vLLM's names and defaults."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from common.errors import InvalidRequestError

_MAX_LOGPROBS = 20
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


# vLLM < 0.10 spelled it GuidedDecodingParams (SamplingParams.guided_decoding): the same thing.
GuidedDecodingParams = StructuredOutputsParams


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
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    # Stream a sequence's tokens in groups of this many (the first token and the last group go out at
    # once); raises the engine's --stream-interval for this request, never lowers it. None: the engine's.
    stream_interval: int | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name for structured_outputs: moved there on construction (this field is then None).
    guided_decoding: StructuredOutputsParams | None = None

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
        if self.top_k is not None and self.top_k <= 0:
            # vLLM spells "disabled" as 0 or -1; we keep None as the one spelling.
            if self.top_k in (0, -1):
                self.top_k = None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` naming the first bad field."""
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
        _check(self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= _MAX_LOGPROBS),
               "logprobs", f"must be an integer in [0, {_MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.stream_interval is None or (_int(self.stream_interval) and self.stream_interval >= 1),
               "stream_interval", f"must be an integer >= 1, got {self.stream_interval!r}")
        _check(self.seed is None or _int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                _check(_finite(bias) and -100 <= bias <= 100, "logit_bias",
                       f"bias for token {tok} must be in [-100, 100], got {bias!r}")
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", self.stop_token_ids),
                              ("logit_bias", list(self.logit_bias or {}))):
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
