"""What every reasoning parser shares: a model's output split into its thinking and its answer, whole or streamed.

A reasoning model writes its thinking first, closed by an end tag (``</think>``), then the answer. A parser reads
the text two ways that must agree: ``parse`` over the whole output, and a :class:`ReasoningStream` fed the output
in pieces (the detokenizer's deltas). Whether the output *starts* inside the thinking block is decided before the
first token (``thinking_at_start``: from the prompt, whose template may open the block or close it, and from the
request), so the stream never looks ahead for it.

Inside the block the first start tag is dropped (a model that writes its own ``<think>``; a template that wrote
it into the prompt leaves none) and the first end tag closes it; everything after that is the answer, tags and
all. An output that never closes the block is all thinking (max_tokens cut it short). Text that may still become
a tag is held back, never split between the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


@dataclass(frozen=True)
class ReasoningOutput:
    """Text split in two: the thinking (tags removed) and the answer."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One sequence's output, fed in pieces: each piece comes back split into thinking and answer; ``finish``
    flushes what was held back."""

    def __init__(self, start_tag: str, end_tag: str, thinking: bool) -> None:
        self._start = start_tag
        self._end = end_tag
        self.thinking = thinking  # still inside the thinking block
        self._started = False      # the block's start tag was seen (and dropped)
        self._held = ""            # the end of the thinking that may still become a tag

    def feed(self, text: str) -> ReasoningOutput:
        if not self.thinking:
            return ReasoningOutput(content=text)
        buf = self._held + text
        reasoning: list[str] = []
        while True:
            end = buf.find(self._end)
            start = -1 if self._started else buf.find(self._start)
            if start >= 0 and (end < 0 or start < end):
                reasoning.append(buf[:start])
                buf = buf[start + len(self._start):]
                self._started = True
                continue
            if end >= 0:
                reasoning.append(buf[:end])
                self.thinking = False
                self._held = ""
                return ReasoningOutput("".join(reasoning), buf[end + len(self._end):])
            keep = _partial_suffix(buf, self._end)
            if not self._started:
                keep = max(keep, _partial_suffix(buf, self._start))
            reasoning.append(buf[:len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            return ReasoningOutput("".join(reasoning))

    def finish(self) -> ReasoningOutput:
        held, self._held = self._held, ""
        return ReasoningOutput(reasoning=held) if self.thinking else ReasoningOutput()


class ReasoningParser:
    """One model family's thinking tags, and when its output starts inside the block."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def thinking_at_start(self, prompt_ends_thinking: bool, template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the output opens inside the thinking block. ``prompt_ends_thinking``: the prompt closed the
        block last (a template that turned thinking off, as vLLM's ``is_reasoning_end`` of the prompt);
        ``template_kwargs``: the request's chat_template_kwargs. By default the block is open unless the prompt
        closed it: the model thinks first, whether it writes the start tag or its template did."""
        return not prompt_ends_thinking

    def parse(self, text: str, thinking: bool) -> ReasoningOutput:
        """The whole output split (``thinking``: it starts inside the block)."""
        if not thinking:
            return ReasoningOutput(content=text)
        head, closed, tail = text.partition(self.end_tag)
        return ReasoningOutput(head.replace(self.start_tag, "", 1), tail if closed else "")

    def stream(self, thinking: bool) -> ReasoningStream:
        return ReasoningStream(self.start_tag, self.end_tag, thinking)


def prompt_ends_thinking(prompt_ids: Sequence[int] | np.ndarray, start_id: int, end_id: int) -> bool:
    """Whether the last thinking tag in the prompt is the end tag (vLLM's ``is_reasoning_end`` of the prompt):
    a template that closed the block (Qwen3's ``enable_thinking=false`` writes ``<think>\\n\\n</think>``)."""
    ids = np.asarray(prompt_ids)
    tags = np.flatnonzero((ids == start_id) | (ids == end_id))
    return bool(len(tags)) and int(ids[tags[-1]]) == end_id


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
