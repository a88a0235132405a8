"""Banned words as token sequences, tokenized as vLLM's ``SamplingParams.update_from_tokenizer`` tokenizes them.

Each word is tokenized as it is (its leading whitespace stripped) and again with one leading space, so that it is
banned at the start of the text and after a space alike; the spaced form is kept only when it is as many tokens as
the bare one and starts with another token (else it adds nothing the bare form does not already ban). The engine
then never samples the last token of a sequence whose other tokens are the output's latest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.errors import InvalidRequestError

# Bounds on one request's list: each word is tokenized twice and every step checks every sequence.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256

Encode = Callable[[str], list[int]]


def check_bad_words(words: Sequence[str]) -> None:
    """Raise :class:`InvalidRequestError` naming ``bad_words`` unless each word has text and the list is bounded."""
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequestError("bad_words", f"may hold at most {MAX_BAD_WORDS} words, got {len(words)}")
    for word in words:
        if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidRequestError("bad_words", f"each word must be 1 to {MAX_BAD_WORD_CHARS} characters and not "
                                                   f"only whitespace, got {str(word)[:32]!r}")


def bad_words_token_ids(words: Sequence[str], encode: Encode) -> list[list[int]]:
    """The token sequences that ban ``words``; ``encode``: text to token ids without special tokens."""
    check_bad_words(words)
    sequences: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        if bare:
            sequences.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            sequences.append(spaced)
    return sequences
