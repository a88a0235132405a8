"""Outputs constrained by tool_choice: guided decoding already made them calls, these read them back.

``required``: a JSON array of ``{"name": ..., "parameters": {...}}`` (vLLM's shape), held until the output
ends (a truncated array is content). A named function: the whole output is that call's arguments, streamed
as they come (the grammar guarantees them; only max_tokens can cut them short, as with OpenAI).
"""

from __future__ import annotations

import json

from engine.text.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    arguments_json,
    new_call_id,
)


class RequiredToolParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        try:
            items = json.loads(text)
        except ValueError:
            return ParsedOutput(text)
        if not isinstance(items, list) or not items:
            return ParsedOutput(text)
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return ParsedOutput(text)
            name, parameters = item.get("name"), item.get("parameters", {})
            if not isinstance(name, str) or name not in self.tool_names or not isinstance(parameters, dict):
                return ParsedOutput(text)
            calls.append(ParsedCall(name, arguments_json(parameters)))
        return self._limit("", calls)

    def stream(self) -> ToolCallStream:
        return _WholeOutputStream(self)


class _WholeOutputStream(ToolCallStream):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser.max_calls)
        self._parser = parser
        self._buf: list[str] = []

    def feed(self, text: str) -> StreamDelta:
        self._buf.append(text)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        parsed = self._parser.parse("".join(self._buf))
        self._buf = []
        out = StreamDelta(content=parsed.content)
        for call in parsed.calls:
            self._emit(out, call)
        return out


class NamedToolParser(ToolParser):
    """The one function ``name``; ``tool_names`` is just it."""

    def __init__(self, name: str) -> None:
        super().__init__((name,), max_calls=1)
        self.name = name

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput("", (ParsedCall(self.name, text),))

    def stream(self) -> ToolCallStream:
        return _NamedStream(self.name)


class _NamedStream(ToolCallStream):
    calls_whole = False  # the arguments stream as they come: cut short, they are cut short

    def __init__(self, name: str) -> None:
        super().__init__(max_calls=1)
        self._name = name

    def feed(self, text: str) -> StreamDelta:
        if not text:
            return StreamDelta()
        return StreamDelta(calls=[self._delta(text)])

    def finish(self) -> StreamDelta:
        # An empty output is still the call (with empty arguments): the request asked for it.
        return StreamDelta(calls=[self._delta("")]) if not self.calls_made else StreamDelta()

    def _delta(self, text: str) -> ToolCallDelta:
        if self.calls_made:
            return ToolCallDelta(0, arguments=text)
        self.calls_made = 1
        return ToolCallDelta(0, new_call_id(), self._name, text)
