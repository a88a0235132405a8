"""Structured outputs in the worker: compiling and caching constraints, per-sequence matchers, step masks, and the
sampler applying them. The vocabulary is the default model's (engine.text loads it, as an entry point would)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import torch

from common.errors import InvalidRequestError
from engine.config import default_model_path
from engine.core.request import SequenceId
from engine.core.sampling_params import SamplingParams, StructuredOutputsParams
from engine.text import Tokenizer
from engine.worker import structured_output
from engine.worker.sampler import Sampler, SamplingRow
from engine.worker.structured_output import GrammarVocabulary, StructuredOutputs, TokenMasks

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def vocabulary(tokenizer: Tokenizer) -> GrammarVocabulary:
    return GrammarVocabulary.from_tokenizer(tokenizer)


@pytest.fixture(params=[True, False], ids=["overlapped", "inline"])
def so(request: pytest.FixtureRequest, tokenizer: Tokenizer, vocabulary: GrammarVocabulary) -> StructuredOutputs:
    return StructuredOutputs(vocabulary, tokenizer.vocab_size, {EOS}, overlap=request.param)


def _allowed(masks: TokenMasks, j: int, vocab: int) -> set[int]:
    return set(torch.nonzero(masks.allowed(vocab, torch.device("cpu"))[j]).flatten().tolist())


def _prefix_tokens(tokenizer: Tokenizer, words: list[str]) -> set[int]:
    """Every token whose bytes are a non-empty prefix of one of ``words``: what may start them."""
    encoded = [w.encode() for w in words]
    return {t for t in range(tokenizer.vocab_size)
            if (b := tokenizer.token_to_bytes(t)) and any(w.startswith(b) for w in encoded)}


def _tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- compiling ---------------------------------------------------------------------------------------------
def test_compiled_grammars_are_cached_by_kind_and_text(so: StructuredOutputs,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    a = so.compile(StructuredOutputsParams(json=schema))
    assert so.compile(StructuredOutputsParams(json=json.dumps(schema))) is a  # the same schema as JSON text
    # The order of properties is the order fields are generated in: another order is another grammar.
    reordered = {"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}
    assert so.compile(StructuredOutputsParams(json=reordered)) is not a
    regex, grammar = StructuredOutputsParams(regex="x"), StructuredOutputsParams(grammar='start: "x"')
    assert so.compile(regex) is not so.compile(grammar)
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_SIZE", 2)
    first = so.compile(StructuredOutputsParams(regex="[0-9]+"))
    so.compile(StructuredOutputsParams(regex="[a-z]+"))
    so.compile(StructuredOutputsParams(regex="[A-Z]+"))  # evicts the least recently used
    assert so.compile(StructuredOutputsParams(regex="[0-9]+")) is not first


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(regex="[a-z"), "structured_outputs.regex"),
    (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json"),
    (StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'),
     "structured_outputs.json"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(grammar='root ::= ("a" | "b"'), "structured_outputs.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(so: StructuredOutputs,
                                                                        spec: StructuredOutputsParams,
                                                                        field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        so.compile(spec)
    assert e.value.field == field


def test_gbnf_grammars_are_accepted(so: StructuredOutputs, tokenizer: Tokenizer) -> None:
    template = so.compile(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))
    matcher = template.deep_copy()
    assert matcher.consume_tokens(_tokens(tokenizer, "yes")) and matcher.is_stopped()


def test_a_pathological_regex_costs_bounded_time(so: StructuredOutputs) -> None:
    t0 = time.perf_counter()
    spec = StructuredOutputsParams(regex="(a|b)*a(a|b){25}(.*x){200}")
    so.compile(spec)
    pending = so.start_masks([SequenceId("r")], [spec])
    assert pending is not None
    pending.result()
    assert time.perf_counter() - t0 < 5.0


# -- matchers and masks ------------------------------------------------------------------------------------
def test_no_constrained_row_allocates_nothing(so: StructuredOutputs) -> None:
    assert so.start_masks([SequenceId("a"), SequenceId("b")], [None, None]) is None
    assert so.matchers == {}
    assert so.stats.steps == 0


def test_masks_allow_exactly_the_tokens_that_can_start_a_choice(so: StructuredOutputs, tokenizer: Tokenizer) -> None:
    choice = StructuredOutputsParams(choice=["yes", "no"])
    owners = [SequenceId("free"), SequenceId("c"), SequenceId("free2")]
    pending = so.start_masks(owners, [None, choice, None])
    assert pending is not None
    masks = pending.result()
    assert masks.rows == [1]
    assert _allowed(masks, 0, tokenizer.vocab_size) == _prefix_tokens(tokenizer, ["yes", "no"])
    assert set(so.matchers) == {SequenceId("c")}


def test_a_complete_grammar_allows_only_eos_and_ends_the_sequence(so: StructuredOutputs,
                                                                  tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(regex="[0-9]+")
    seq = SequenceId("r")
    ids = _tokens(tokenizer, "42")
    for token in ids:
        so.start_masks([seq], [spec])
        assert so.advance([seq], [token]) == (set(), set())
    # "42" may go on ("421") or end: digits and EOS are allowed; EOS completes it.
    pending = so.start_masks([seq], [spec])
    assert pending is not None
    allowed = _allowed(pending.result(), 0, tokenizer.vocab_size)
    assert EOS in allowed and set(_tokens(tokenizer, "7")) <= allowed and not set(_tokens(tokenizer, "a")) & allowed
    assert so.advance([seq], [EOS]) == ({seq}, set())

    # A choice is complete with its last token: only EOS is allowed after it, and the sequence ends at once.
    choice = StructuredOutputsParams(choice=["yes", "no"])
    c = SequenceId("c")
    so.start_masks([c], [choice])
    assert so.advance([c], _tokens(tokenizer, "no")) == ({c}, set())
    pending = so.start_masks([c], [choice])
    assert pending is not None
    assert _allowed(pending.result(), 0, tokenizer.vocab_size) == {EOS}


def test_a_token_the_grammar_refuses_fails_the_sequence(so: StructuredOutputs, tokenizer: Tokenizer) -> None:
    seq = SequenceId("r")
    so.start_masks([seq], [StructuredOutputsParams(regex="[0-9]+")])
    assert so.advance([seq], _tokens(tokenizer, "a")) == (set(), {seq})


def test_fork_copies_the_state_and_release_frees_it(so: StructuredOutputs, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams(choice=["abc", "abd"])
    parent, child, other = SequenceId("p"), SequenceId("p", 1), SequenceId("free")
    so.start_masks([parent], [spec])
    (ab,) = [t for t in _tokens(tokenizer, "ab")]
    assert so.advance([parent], [ab]) == (set(), set())
    so.fork(parent, child)
    so.fork(other, SequenceId("free", 1))  # an unconstrained sequence forks nothing
    assert set(so.matchers) == {parent, child}
    c, d = _tokens(tokenizer, "c"), _tokens(tokenizer, "d")
    # The child continues from "ab": "c" completes it; the parent, untouched by the child, completes with "d".
    assert so.advance([child], c) == ({child}, set())
    assert so.advance([parent], d) == ({parent}, set())
    so.release([parent, child, other])
    assert so.matchers == {}


# -- the sampler applies them ------------------------------------------------------------------------------
V = 8


def _masks(rows: list[int], allowed: list[set[int]]) -> TokenMasks:
    words = torch.zeros((len(rows), 1), dtype=torch.int32)
    for j, tokens in enumerate(allowed):
        words[j, 0] = sum(1 << t for t in tokens)
    return TokenMasks(rows, words)


def _row(params: SamplingParams, output: list[int] | None = None) -> SamplingRow:
    return SamplingRow(params, [1], list(output or []), None)


def test_masks_constrain_their_rows_and_leave_the_others_as_they_are() -> None:
    sampler = Sampler(V, {0})
    logits = torch.tensor([[0.0, 1, 2, 3, 4, 5, 6, 7]] * 3)
    rows = [_row(SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=4))] * 3
    plain = sampler.process_logits(logits, rows)
    masked = sampler.process_logits(logits, rows, _masks([1], [{2, 5}]))
    assert torch.equal(masked[0], plain[0]) and torch.equal(masked[2], plain[2])
    assert masked[1].tolist() == [-INF, -INF, plain[1, 2].item(), -INF, -INF, plain[1, 5].item(), -INF, -INF]


INF = float("inf")


def test_the_greedy_fast_path_does_not_skip_the_masks() -> None:
    sampler = Sampler(V, {0})
    logits = torch.tensor([[0.0, 1, 2, 3, 4, 5, 6, 7], [7.0, 6, 5, 4, 3, 2, 1, 0]])
    rows = [_row(SamplingParams(temperature=0.0))] * 2
    assert sampler(logits, rows).token_ids == [7, 0]
    assert sampler(logits, rows, _masks([0, 1], [{3}, {4, 5}])).token_ids == [3, 4]


def test_sampled_rows_only_draw_allowed_tokens() -> None:
    sampler = Sampler(V, {0})
    logits = torch.zeros((4, V))
    rows = [_row(SamplingParams(temperature=1.0, top_k=5, top_p=0.9))] * 4
    for _ in range(20):
        tokens = sampler(logits, rows, _masks([0, 2], [{1, 6}, {3}])).token_ids
        assert tokens[0] in (1, 6) and tokens[2] == 3


def test_min_tokens_yields_to_a_grammar_that_allows_only_ending() -> None:
    """Before min_tokens EOS is masked; a grammar that allows nothing but EOS wins (never an all -inf row),
    one that allows other tokens too keeps EOS masked."""
    sampler = Sampler(V, {0})
    logits = torch.tensor([[9.0, 1, 2, 3, 4, 5, 6, 7]] * 2)
    rows = [_row(SamplingParams(temperature=0.0, min_tokens=5), output=[3])] * 2
    processed = sampler.process_logits(logits, rows, _masks([0, 1], [{0}, {0, 4}]))
    assert processed[0].tolist() == [9.0] + [-INF] * 7
    assert processed[1].tolist() == [-INF] * 4 + [4.0] + [-INF] * 3
    assert sampler(logits, rows, _masks([0, 1], [{0}, {0, 4}])).token_ids == [0, 4]
