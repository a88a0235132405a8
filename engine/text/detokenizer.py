"""Incremental detokenization with stop strings.

Text is produced with the prefix-offset / read-offset method of vLLM and TGI: each step decodes a
short window of recent tokens twice (without and with the new ones) and emits the difference, so the
cost per token stays constant and decoders that depend on neighbours (SentencePiece's leading space,
byte fallback) still see context. A window whose text ends in U+FFFD holds half a UTF-8 character:
nothing is emitted until a later token completes it.

Decoded text then passes a stop-string filter that holds back the longest suffix that could still
grow into a stop string, so a stop string is never emitted, not even in part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.text.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizerDelta:
    """New text safe to show, and the stop string that ended the request (None if none matched)."""

    text: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns a request's stream of output token ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | np.ndarray, *,
                 skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        # A list or an integer array (token-id prompts stay arrays): plain ints either way.
        context = [int(t) for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]] if len(prompt_token_ids) else []
        # Only the tokens that can still be in a window are kept: [prefix_offset:] of this list.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pending = ""          # decoded, not yet emitted: it may be the start of a stop string
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_string: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.stop_string is not None

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Feed new output tokens; returns the text that is now safe to emit.

        Once a stop string has matched, later tokens (already in flight from the engine) are ignored.
        """
        if self.is_stopped:
            return DetokenizerDelta("")
        for token_id in token_ids:
            self.num_output_tokens += 1
            self._ids.append(token_id)
            self._pending += self._decode_step(final=False)
            # Checked per token so that text decoded after a stop string is never kept.
            if self._stops and self._match_stop():
                return DetokenizerDelta(self._emit_stopped(), self.stop_string)
        return DetokenizerDelta(self._emit_safe())

    def finish(self) -> str:
        """Flush everything held back, for a request that ended without a stop string (EOS, length)."""
        if self.is_stopped:
            return ""
        self._pending += self._decode_step(final=True)
        if self._stops and self._match_stop():
            return self._emit_stopped()
        text, self._pending = self._pending, ""
        self.output_text += text
        return text

    # ---- decoding -------------------------------------------------------------------------------

    def _decode_step(self, *, final: bool) -> str:
        """Text of the tokens after the read offset, or "" while it ends in half a character."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special_tokens)
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing new yet
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text):]
        # Slide the window and drop what can no longer be in it, keeping memory per request constant.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return delta

    # ---- stop strings ---------------------------------------------------------------------------

    def _match_stop(self) -> bool:
        """Find the earliest stop string in the pending text; cut the pending text there."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.stop_string = stop
        self._pending = self._pending[:at + len(stop)] if self._include_stop else self._pending[:at]
        return True

    def _emit_stopped(self) -> str:
        text, self._pending = self._pending, ""
        self.output_text += text
        return text

    def _emit_safe(self) -> str:
        """Emit the pending text except a suffix that is the start of some stop string."""
        hold = self._held_suffix_len()
        text = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        self.output_text += text
        return text

    def _held_suffix_len(self) -> int:
        pending = self._pending
        longest = 0
        for stop in self._stops:
            # Longest proper prefix of `stop` that the pending text ends with.
            for n in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
