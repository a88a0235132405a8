"""engine/text/detokenizer.py: streamed text equals a full decode, no half characters, no leaked stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.text import DetokenizerDelta, IncrementalDetokenizer, Tokenizer

SENTENCE = "The capital of France is Paris. It is a beautiful city."
UNICODE_TEXTS = [
    "I ❤️ Rust 🦀 and 👩‍👩‍👧 families 🎉🎉 — ok",
    "中文测试，日本語のテキスト、한국어 텍스트。",
    "mixed: 🇫🇷 Paris 巴黎 ✓ ∑ x² 𝔘𝔫𝔦",
]


def _prompt(tok: Tokenizer) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}]))


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[DetokenizerDelta]:
    return [detok.add_tokens([i]) for i in ids]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_one_token_at_a_time_equals_full_decode(smollm: Tokenizer, text: str) -> None:
    ids = smollm.encode(text, add_special_tokens=False)
    # The test is only meaningful if characters really are split across tokens.
    assert any(_is_partial(smollm.token_to_bytes(i)) for i in ids)
    detok = IncrementalDetokenizer(smollm, _prompt(smollm))
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d.text and d.stop_string is None for d in deltas)
    assert any(d.text == "" for d in deltas)  # held while a character was incomplete
    tail = detok.finish()
    assert "".join(d.text for d in deltas) + tail == smollm.decode(ids) == text
    assert detok.output_text == text and detok.num_output_tokens == len(ids)


def _is_partial(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_incomplete_character_at_the_end_is_flushed_as_decode_does(smollm: Tokenizer) -> None:
    ids = smollm.encode("ok 🦀", add_special_tokens=False)[:-1]  # cut inside the crab's bytes
    detok = IncrementalDetokenizer(smollm, [])
    # " 🦀" starts with a token holding the space and the crab's first bytes, so the space waits too.
    assert "".join(d.text for d in _stream(detok, ids)) == "ok"
    assert detok.finish() == smollm.decode(ids)[len("ok"):] == " \ufffd"
    assert detok.output_text == smollm.decode(ids) and detok.output_text.endswith("\ufffd")


def _three_token_stop(tok: Tokenizer) -> tuple[list[int], str]:
    """SENTENCE's ids and a stop string that starts inside one token and ends inside the second next."""
    ids = tok.encode(SENTENCE)
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[1:4] == [" capital", " of", " France"]
    stop = pieces[1][3:] + pieces[2] + pieces[3][:4]
    assert stop == "pital of Fra"
    return ids, stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_three_tokens_never_leaks(smollm: Tokenizer, include: bool) -> None:
    ids, stop = _three_token_stop(smollm)
    at = SENTENCE.index(stop)
    expected = SENTENCE[:at + len(stop)] if include else SENTENCE[:at]
    detok = IncrementalDetokenizer(smollm, _prompt(smollm), stop=[stop], include_stop_str_in_output=include)
    emitted = ""
    for n, token_id in enumerate(ids):
        delta = detok.add_tokens([token_id])
        emitted += delta.text
        if n < 3:
            # Before the stop completes, not a single character of it ("pital of Fra") is out.
            assert delta.stop_string is None
            assert emitted == SENTENCE[:len(emitted)] and len(emitted) <= at
        elif n == 3:
            assert delta.stop_string == stop and detok.stop_string == stop
        else:
            assert delta == DetokenizerDelta("", None)  # tokens already in flight after the stop
    assert emitted == expected == detok.output_text
    assert detok.finish() == "" and detok.output_text == expected


def test_stop_inside_one_batch_drops_the_text_after_it(smollm: Tokenizer) -> None:
    ids, stop = _three_token_stop(smollm)
    detok = IncrementalDetokenizer(smollm, [], stop=["nowhere", stop])
    delta = detok.add_tokens(ids)
    assert delta == DetokenizerDelta("The ca", stop)
    assert detok.add_tokens(ids) == DetokenizerDelta("", None)
    assert detok.output_text == "The ca" and detok.is_stopped


def test_earliest_stop_wins(smollm: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm, [], stop=["city", "Paris", "", "is"])
    assert detok.add_tokens(smollm.encode(SENTENCE)) == DetokenizerDelta("The capital of France ", "is")


def test_possible_stop_prefix_is_held_then_released(smollm: Tokenizer) -> None:
    # " Paris." would stop; " Paris" alone only might, until "." vs something else arrives.
    detok = IncrementalDetokenizer(smollm, [], stop=["Paris!"])
    ids = smollm.encode("The capital is Paris", add_special_tokens=False)
    streamed = "".join(d.text for d in _stream(detok, ids))
    assert streamed == "The capital is " and detok.output_text == streamed
    assert detok.finish() == "Paris"
    assert detok.output_text == "The capital is Paris" and detok.stop_string is None


def test_near_miss_is_released_without_finish(smollm: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm, [], stop=["Paris!"])
    deltas = _stream(detok, smollm.encode(SENTENCE))
    assert "".join(d.text for d in deltas) == SENTENCE  # "Paris." can no longer become "Paris!"
    assert detok.finish() == ""


@pytest.mark.parametrize("skip, expected", [(True, "Sure thing."), (False, "Sure thing.<|im_end|>")])
def test_skip_special_tokens(smollm: Tokenizer, skip: bool, expected: str) -> None:
    ids = smollm.encode("<|im_start|>Sure thing.<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    detok = IncrementalDetokenizer(smollm, _prompt(smollm), skip_special_tokens=skip)
    streamed = "".join(d.text for d in _stream(detok, ids[1:])) + detok.finish()
    assert streamed == expected == smollm.decode(ids[1:], skip_special_tokens=skip)


def test_stop_string_can_match_special_token_text_when_not_skipped(smollm: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm, [], skip_special_tokens=False, stop=["<|im_end|>"])
    assert detok.add_tokens(smollm.encode("Done.<|im_end|>more")) == DetokenizerDelta("Done.", "<|im_end|>")


def test_sentencepiece_leading_space_comes_from_prompt_context(tiny_spm_gguf: str) -> None:
    tok = Tokenizer.from_pretrained(tiny_spm_gguf)
    prompt = tok.encode("hello")
    out = tok.encode(" world! the ☃", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, out)
    assert all("\ufffd" not in d.text for d in deltas)
    full = tok.decode(prompt + out)
    assert "".join(d.text for d in deltas) + detok.finish() == full[len(tok.decode(prompt)):] == " world! the ☃"


class _CountingTokenizer(Tokenizer):
    """Records how many ids each decode call gets, to prove the work per token is bounded."""

    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner.backend, bos_token_id=inner.bos_token_id, eos_token_id=inner.eos_token_id)
        self.decoded_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_step_decodes_a_short_window_not_the_whole_output(smollm: Tokenizer) -> None:
    counting = _CountingTokenizer(smollm)
    text = (SENTENCE + " 🦀中文 ") * 40
    ids = smollm.encode(text, add_special_tokens=False)
    assert len(ids) > 500
    detok = IncrementalDetokenizer(counting, _prompt(smollm))
    out = "".join(d.text for d in _stream(detok, ids)) + detok.finish()
    assert out == text
    assert max(counting.decoded_lengths) <= 10
