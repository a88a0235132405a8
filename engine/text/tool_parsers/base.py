"""What every tool-call parser shares: the parsed result, streamed deltas, and the stream's bookkeeping.

A parser reads the model's text two ways that must agree: ``parse`` over the whole output, and a
``ToolCallStream`` fed the output in pieces. A call is emitted whole (id, name and arguments in one delta)
once its text is complete and valid: malformed output becomes content, and a call already sent could not
be taken back.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: the content outside the calls, and the calls in the order they were made."""

    content: str
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a streamed call: the first carries ``id`` and ``name``; ``arguments`` are JSON text fragments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one piece of output turned into: content text and call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def arguments_json(arguments: Any) -> str:
    # Non-ASCII stays as is, as vLLM returns it.
    return json.dumps(arguments, ensure_ascii=False)


class ToolCallStream(ABC):
    """Turns one sequence's text, fed in pieces, into content and call deltas; ``finish`` flushes the rest.

    ``max_calls`` (parallel_tool_calls false: 1) drops the calls after that many, and their text.
    ``calls_whole``: a call is emitted only once complete, so an output cut short still made whole calls.
    """

    calls_whole = True

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls_made = 0

    @abstractmethod
    def feed(self, text: str) -> StreamDelta: ...

    @abstractmethod
    def finish(self) -> StreamDelta: ...

    def _emit(self, out: StreamDelta, call: ParsedCall) -> None:
        if self.max_calls is not None and self.calls_made >= self.max_calls:
            return
        out.calls.append(ToolCallDelta(self.calls_made, new_call_id(), call.name, call.arguments))
        self.calls_made += 1


class ToolParser(ABC):
    """One model family's call syntax, for a request's tools (a call naming another function is content)."""

    def __init__(self, tool_names: Collection[str], max_calls: int | None = None) -> None:
        self.tool_names = frozenset(tool_names)
        self.max_calls = max_calls

    def known_call(self, name: object, arguments: object) -> ParsedCall | None:
        """The call of a request's tool with object arguments, or None (the text then stays content)."""
        if not isinstance(name, str) or name not in self.tool_names or not isinstance(arguments, dict):
            return None
        return ParsedCall(name, arguments_json(arguments))

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput: ...

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    def _limit(self, content: str, calls: list[ParsedCall]) -> ParsedOutput:
        return ParsedOutput(content, tuple(calls if self.max_calls is None else calls[: self.max_calls]))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (held back: it may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
