"""What every tool-call parser shares: the parsed result, streamed deltas, and the stream's bookkeeping.

A parser reads the model's text two ways that must agree: a ``ToolCallStream`` fed the output in pieces,
and ``parse`` over the whole output, which by default is that stream fed the output at once. A call streams
as a first delta (id and name) and fragments of its arguments' JSON text, which join to its arguments.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar


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


def arguments_json(arguments: Any, *, allow_nan: bool = True) -> str:
    # Non-ASCII stays as is, as vLLM returns it; a lone surrogate (a Python literal's "\ud83d") cannot be sent
    # as UTF-8 and is written as an escape.
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=allow_nan)
    if any("\ud800" <= c <= "\udfff" for c in text):
        text = "".join(f"\\u{ord(c):04x}" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


class ToolCallStream(ABC):
    """Turns one sequence's text, fed in pieces, into content and call deltas; ``finish`` flushes the rest.

    ``max_calls`` (parallel_tool_calls false: 1) drops the calls after that many, and their text.
    ``calls_whole``: every call sent has whole arguments (read once ``finish`` returned): an output cut short
    after its calls still made them.
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
    """One model family's call syntax, for a request's tools (a call naming another function is content).

    ``parameters``: each tool's JSON schema of its arguments, by name, for formats whose values are text
    that the schema types. ``keeps_special_tokens``: the format's markers are special tokens, which the
    detokenizer must keep in the text for the parser to see them.
    """

    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tool_names: Collection[str], max_calls: int | None = None, *,
                 parameters: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.tool_names = frozenset(tool_names)
        self.max_calls = max_calls
        self.parameters = dict(parameters or {})

    def is_tool(self, name: object) -> bool:
        return isinstance(name, str) and name in self.tool_names

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        content: list[str] = []
        calls: list[list[str]] = []
        for delta in (stream.feed(text), stream.finish()):
            content.append(delta.content)
            for call in delta.calls:
                if call.name:
                    calls.append([call.name, call.arguments])
                else:
                    calls[-1][1] += call.arguments
        return ParsedOutput("".join(content), tuple(ParsedCall(name, args) for name, args in calls))

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
