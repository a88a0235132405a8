"""vLLM's ``bad_words``: the words tokenized as vLLM tokenizes them (checked with transformers' tokenizer of the
default model), the sampler banning a sequence's last token only after the rest of it, and the default model
never producing a word it produces without the ban."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from common.errors import InvalidRequestError
from engine.core.sampling_params import BeamSearch, SamplingParams
from engine.text import Tokenizer
from engine.text.bad_words import MAX_BAD_WORDS, bad_words_token_ids
from engine.worker.sampler import Sampler, SamplingRow

V = 8


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _row(bad: list[list[int]] | None, output: list[int], **kw: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0.0, bad_words_token_ids=bad, **kw), [1], list(output), None)


def _greedy(rows: list[SamplingRow], favourite: int = 5) -> list[int]:
    """Each row's greedy token when ``favourite`` has the highest logit and 4 the next highest."""
    logits = torch.zeros(len(rows), V)
    logits[:, favourite] = 3.0
    logits[:, 4] = 2.0
    return Sampler(vocab_size=V, eos_token_ids={0})(logits, rows).token_ids


def test_a_one_token_word_is_banned_at_every_step() -> None:
    assert _greedy([_row([[5]], []), _row([[5]], [2, 3]), _row(None, [])]) == [4, 4, 5]


def test_a_longer_word_bans_its_last_token_only_after_the_rest_of_it() -> None:
    bad = [[2, 3, 5]]
    rows = [_row(bad, [7, 2, 3]),   # the output ends with the prefix: 5 would complete the word
            _row(bad, [2, 3, 7]),   # the prefix is not the latest tokens
            _row(bad, [3]),         # only part of the prefix
            _row(bad, [2]),
            _row(bad, [])]
    assert _greedy(rows) == [4, 5, 5, 5, 5]
    # A word as long as the output plus one: the whole output must be its prefix.
    assert _greedy([_row([[2, 5]], [2]), _row([[2, 5]], [6])]) == [4, 5]


def test_bad_words_hold_for_sampled_rows_and_rows_asking_for_logprobs() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = [SamplingRow(SamplingParams(temperature=1.0, bad_words_token_ids=[[t] for t in range(1, V)]),
                        [1], [], generator) for _ in range(4)]
    assert Sampler(vocab_size=V, eos_token_ids=set())(torch.zeros(4, V), rows).token_ids == [0, 0, 0, 0]
    logits = torch.tensor([[0.0, 0, 0, 0, 2.0, 3.0, 0, 0]])
    out = Sampler(vocab_size=V, eos_token_ids={0})(logits, [_row([[5]], [], logprobs=2)])
    assert out.token_ids == [4]
    entry = out.logprobs[0]
    assert entry is not None and list(entry[1]) == [5, 4]  # the raw distribution's, as vLLM reports them


def test_a_sequence_with_bad_words_samples_one_token_per_step() -> None:
    # The prefix is compared with the latest output tokens: no step may run ahead of them.
    assert SamplingParams(bad_words_token_ids=[[3]]).follows_each_token


@pytest.mark.parametrize(("params", "field"), [
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[-1]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[2]], beam_search=BeamSearch(2), temperature=0.0), "bad_words_token_ids"),
])
def test_bad_token_sequences_are_refused(params: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**params)
    assert e.value.field == field
    with pytest.raises(InvalidRequestError, match=r"out of range \[0, 8\)"):
        SamplingParams(bad_words_token_ids=[[9]]).validate(vocab_size=V)


# -- tokenizing: vLLM's rule, with transformers' tokenizer as the reference -----------------------------------


def _vllm_rule(word: str, encode: Any) -> list[list[int]]:
    """vLLM's update_from_tokenizer for one word, written from its description: the bare word, then the word
    after a space when that is as many tokens and starts differently."""
    bare = encode(word.lstrip())
    spaced = encode(" " + word.lstrip())
    return [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from engine.config import default_model_path

    return Tokenizer.from_pretrained(default_model_path())


@pytest.mark.parametrize("words", [["Paris"], ["  capital", "France is"], ["hello world", "x"]])
def test_words_are_tokenized_bare_and_after_a_space(tokenizer: Tokenizer, default_hf_tokenizer: Any,
                                                    words: list[str]) -> None:
    def reference(text: str) -> list[int]:
        return list(default_hf_tokenizer.encode(text, add_special_tokens=False))

    got = bad_words_token_ids(words, lambda text: tokenizer.encode(text, add_special_tokens=False))
    assert got == [ids for w in words for ids in _vllm_rule(w, reference)]
    assert len(got) > len(words)  # at least one spaced form is its own sequence


@pytest.mark.parametrize("words", [[""], ["   "], ["x" * 257], ["a"] * (MAX_BAD_WORDS + 1)])
def test_empty_long_or_too_many_words_are_refused(words: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        bad_words_token_ids(words, lambda text: [1])
    assert e.value.field == "bad_words"


# -- the default model, offline ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_model_never_says_a_banned_word() -> None:
    from engine import LLM

    llm = LLM(dtype="float32", kv_cache_memory="256MiB", seed=0)
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate(prompt, greedy)[0].outputs[0]
    word = free.text.split()[0].strip(".,")  # the first word it says unconstrained
    banned = llm.generate(prompt, greedy.clone(bad_words=[word]))[0].outputs[0]
    sequences = bad_words_token_ids([word], lambda text: llm.tokenizer.encode(text, add_special_tokens=False))
    ids = banned.token_ids
    assert word in free.text and word not in banned.text
    for seq in sequences:  # no banned sequence anywhere in the output
        assert all(ids[i:i + len(seq)] != seq for i in range(len(ids)))
    # Several words at once, and the parameters given as a list with one per prompt.
    two = free.text.split()[1].strip(".,")
    outs = llm.generate([prompt, prompt], [greedy.clone(bad_words=[word, two]), greedy])
    assert word not in outs[0].outputs[0].text.split() and two not in outs[0].outputs[0].text.split()
    assert outs[1].outputs[0].token_ids == free.token_ids
