"""Structured outputs on llguidance: compiled grammars, one matcher per constrained sequence, a step's masks.

A constraint (JSON schema, regex, choice, grammar) is compiled once per (kind, text) into a template matcher
when its request is added; each constrained sequence gets a copy of it when first sampled and feeds it every
token it samples. Each step the matchers of the rows being sampled fill a bitmask (one bit per token) that
the sampler applies; llguidance fills it with the GIL released, so it runs on a thread while the model runs.

Only an entry point may load the tokenizer (``engine.text``); it hands the worker a :class:`GrammarVocabulary`,
plain data llguidance builds its own tokenizer from.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import llguidance
import llguidance.numpy  # not llguidance.torch: see _fill
import torch

from common.errors import InvalidRequestError

if TYPE_CHECKING:  # the core's types, handed down by the executor: annotations only
    from engine.core.request import SequenceId
    from engine.core.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first): a template matcher holds its lexer's states.
GRAMMAR_CACHE_SIZE = 256
# llguidance's work limits, set here once: compiling or one step's mask that would exceed them fails (the request
# is refused, or the sequence ends with an error) instead of taking unbounded time. The figures are llguidance's
# defaults (~20 ms of regex analysis per constraint, ~15 ms of lexing per mask), except that errors do not echo
# the parser's state back to the caller.
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                     max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)


class _HasBackend(Protocol):
    @property
    def backend(self) -> _TokenizerJson: ...


class _TokenizerJson(Protocol):
    def to_str(self) -> str: ...


@dataclass(frozen=True)
class GrammarVocabulary:
    """The tokenizer as llguidance reads it: Hugging Face ``tokenizers`` JSON (``engine.text`` converts a GGUF
    vocabulary to one). Plain data, so it can cross to a worker in another process."""

    tokenizer_json: str

    @classmethod
    def from_tokenizer(cls, tokenizer: _HasBackend) -> GrammarVocabulary:
        """From an ``engine.text.Tokenizer`` (anything with a ``tokenizers`` backend)."""
        return cls(tokenizer.backend.to_str())


@dataclass
class TokenMasks:
    """One step's grammar masks: ``bitmask[j]`` (int32 words, bit ``t % 32`` of word ``t // 32`` set when token
    ``t`` is allowed) constrains sampler row ``rows[j]``; rows not listed are unconstrained."""

    rows: list[int]
    bitmask: torch.Tensor
    _allowed: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """``[len(rows), vocab_size]`` booleans on ``device``: True where the token is allowed."""
        key = (vocab_size, device)
        if key not in self._allowed:
            words = self.bitmask.to(device, non_blocking=True)
            shifts = torch.arange(32, dtype=torch.int32, device=device)
            bits = (words.unsqueeze(-1) >> shifts) & 1
            self._allowed[key] = bits.view(len(self.rows), -1)[:, :vocab_size].bool()
        return self._allowed[key]

    def apply_(self, x: torch.Tensor) -> None:
        """Set the disallowed logits of the constrained rows of ``x`` ``[B, V]`` to -inf, in place."""
        forbidden = ~self.allowed(x.shape[1], x.device)
        if self.rows == list(range(x.shape[0])):
            x.masked_fill_(forbidden, float("-inf"))
            return
        index = torch.tensor(self.rows, device=x.device)
        x.index_copy_(0, index, x.index_select(0, index).masked_fill_(forbidden, float("-inf")))

    def allows_only(self, row: int, token_ids: Iterable[int], vocab_size: int, device: torch.device) -> bool:
        """True when sampler row ``row`` is constrained and its grammar allows none but ``token_ids``."""
        if row not in self.rows:
            return False
        allowed = self.allowed(vocab_size, device)[self.rows.index(row)].clone()
        ids = [t for t in token_ids if 0 <= t < vocab_size]
        if ids:
            allowed[torch.tensor(ids, device=device)] = False
        return not bool(allowed.any())


class PendingMasks:
    """Masks being filled (on the mask thread, or already done): ``result()`` waits for them."""

    def __init__(self, masks: TokenMasks, owner: StructuredOutputs) -> None:
        self._masks = masks
        self._owner = owner

    def result(self) -> TokenMasks:
        t0 = time.perf_counter()
        self._owner._settle()
        self._owner.stats.wait_s += time.perf_counter() - t0
        return self._masks


@dataclass
class MaskStats:
    """Cumulative mask work, for the benchmark: fill time, and the part of it a step waited for."""

    steps: int = 0
    rows: int = 0
    fill_s: float = 0.0   # time spent filling masks
    wait_s: float = 0.0   # time the step spent blocked on them (all of fill_s when not overlapped)


class StructuredOutputs:
    """The worker's llguidance state: its tokenizer, compiled grammars cached by (kind, text), the matchers of
    constrained sequences keyed by SequenceId (kept through preemption, dropped by ``release``)."""

    def __init__(self, vocabulary: GrammarVocabulary, vocab_size: int, eos_token_ids: Iterable[int], *,
                 disable_any_whitespace: bool = False, overlap: bool = True) -> None:
        eos = sorted(eos_token_ids)
        try:
            self.tokenizer = llguidance.LLTokenizer(vocabulary.tokenizer_json, n_vocab=vocab_size,
                                                    eos_token=eos or None)
        except Exception as e:  # noqa: BLE001 — llguidance raises plain exceptions for a tokenizer it cannot read
            raise ValueError(f"llguidance cannot read the tokenizer for structured outputs: {e}") from e
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)  # type: ignore[arg-type]
        self.json_options: dict[str, bool] = {"whitespace_flexible": not disable_any_whitespace}
        self.matchers: dict[SequenceId, llguidance.LLMatcher] = {}
        self.stats = MaskStats()
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") if overlap else None
        self._in_flight: Future[None] | None = None  # the fill running on the mask thread

    def _settle(self) -> None:
        """Wait for the fill in flight: a matcher is never touched while the mask thread uses it."""
        if self._in_flight is not None:
            future, self._in_flight = self._in_flight, None
            future.result()

    # -- compiling ------------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The template matcher of ``spec`` (cached); InvalidRequestError naming the field when it does not
        compile within the limits."""
        kind, text = spec.kind, spec.text
        key = (kind, text)
        template = self._compiled.get(key)
        if template is not None:
            self._compiled.move_to_end(key)
            return template
        where = f"structured_outputs.{kind}"
        try:
            grammar = self._grammar(kind, text)
        except ValueError as e:
            raise InvalidRequestError(where, f"does not compile: {e}") from e
        template = llguidance.LLMatcher(self.tokenizer, grammar, limits=self.limits, log_level=0)
        if template.is_error():
            raise InvalidRequestError(where, f"does not compile: {template.get_error()}")
        self._compiled[key] = template
        while len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return template

    def _grammar(self, kind: str, text: str) -> str:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=self.json_options)  # type: ignore[arg-type]
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                defaults=self.json_options)  # type: ignore[arg-type]
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.grammar_from("choice", text)
        if kind == "grammar":  # Lark as is; GBNF / EBNF (``::=`` rules) converted to Lark by llguidance
            return llguidance.grammar_from("grammar", text)
        raise ValueError(f"unknown constraint kind {kind!r}")

    # -- sequences ------------------------------------------------------------------------------------
    def is_constrained(self, seq_id: SequenceId) -> bool:
        return seq_id in self.matchers

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        """``child`` continues from ``parent``'s grammar state (n > 1, beam search); nothing when unconstrained."""
        self._settle()
        matcher = self.matchers.get(parent)
        if matcher is not None:
            self.matchers[child] = matcher.deep_copy()

    def release(self, seq_ids: Iterable[SequenceId]) -> None:
        self._settle()
        for seq_id in seq_ids:
            self.matchers.pop(seq_id, None)

    # -- one step -------------------------------------------------------------------------------------
    def start_masks(self, owners: Sequence[SequenceId], specs: Sequence[StructuredOutputsParams | None],
                    histories: Sequence[Sequence[int]] | None = None) -> PendingMasks | None:
        """Begin filling the masks of sampler rows ``owners`` (``specs[j]``: row j's constraint or None); None,
        and nothing allocated, when no row is constrained. A sequence seen for the first time gets a fresh copy
        of its grammar's template: the n sequences of a request sample their first token together, so each
        starts from the grammar's start (later forks, as beam search makes, go through ``fork``). ``histories[j]``:
        the tokens row j's grammar has already taken, fed to a matcher made now (a request resumed from another
        engine; empty for a new one)."""
        self._settle()
        rows: list[int] = []
        matchers: list[llguidance.LLMatcher] = []
        for j, (seq_id, spec) in enumerate(zip(owners, specs)):
            if spec is None:
                continue
            matcher = self.matchers.get(seq_id)
            if matcher is None:
                matcher = self.matchers[seq_id] = self.compile(spec).deep_copy()
                if histories is not None and histories[j]:
                    matcher.consume_tokens(list(histories[j]))
            rows.append(j)
            matchers.append(matcher)
        if not rows:
            return None
        bitmask = torch.empty(llguidance.numpy.get_bitmask_shape(len(rows), self.vocab_size), dtype=torch.int32)
        masks = TokenMasks(rows, bitmask)
        self.stats.steps += 1
        self.stats.rows += len(rows)
        if self._thread is None:
            t0 = time.perf_counter()
            self._fill(matchers, bitmask)
            self.stats.wait_s += time.perf_counter() - t0
            return PendingMasks(masks, self)
        self._in_flight = self._thread.submit(self._fill, matchers, bitmask)
        return PendingMasks(masks, self)

    def _fill(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
        t0 = time.perf_counter()
        # llguidance.numpy, not llguidance.torch: importing that runs a @torch.compile decorator, which imports
        # torch._dynamo and inductor (seconds of every engine start, ~10^5 objects for every full GC to walk).
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m, j) for j, m in enumerate(matchers)],
                                                     bitmask.numpy())  # a view: the mask lands in the tensor
        self.stats.fill_s += time.perf_counter() - t0

    def advance(self, owners: Sequence[SequenceId], token_ids: Sequence[int]
                ) -> tuple[set[SequenceId], set[SequenceId]]:
        """Feed each constrained sequence its sampled token. Returns (sequences whose grammar is complete: they
        end now, sequences whose matcher failed: a token it refused, or a step over llguidance's limits)."""
        self._settle()
        complete: set[SequenceId] = set()
        failed: set[SequenceId] = set()
        for seq_id, token in zip(owners, token_ids):
            matcher = self.matchers.get(seq_id)
            if matcher is None:
                continue
            matcher.consume_token(token)
            if matcher.is_error():
                logger.warning("%s: structured output failed: %s", seq_id, matcher.get_error())
                failed.add(seq_id)
            elif matcher.is_stopped():
                complete.add(seq_id)
        return complete, failed

    def close(self) -> None:
        self._settle()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
