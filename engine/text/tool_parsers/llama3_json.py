"""Llama 3.1/3.2 JSON calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
several separated by ``;``.

The format has no content around calls: an output that starts like a call (``{`` or the tag, after
whitespace) is either calls throughout or, if any part of it is not a valid call of a known tool, content
as written. Streaming therefore holds such an output until it ends; any other output streams as it comes.
"""

from __future__ import annotations

import json

from engine.text.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    StreamDelta,
    ToolCallStream,
    ToolParser,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return ParsedOutput(text)
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return ParsedOutput(text)
            call = self.call(obj)
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return ParsedOutput(text)
            pos = len(body) - len(rest)
        return self._limit("", calls)

    def call(self, obj: object) -> ParsedCall | None:
        if not isinstance(obj, dict):
            return None
        # Llama's own key is "parameters"; some fine-tunes write "arguments".
        return self.known_call(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))

    def stream(self) -> ToolCallStream:
        return _Llama3Stream(self)


class _Llama3Stream(ToolCallStream):
    def __init__(self, parser: Llama3JsonToolParser) -> None:
        super().__init__(parser.max_calls)
        self._parser = parser
        self._buf = ""
        self._mode: str | None = None  # "content" or "calls", once the output's start says which

    def feed(self, text: str) -> StreamDelta:
        if self._mode == "content":
            return StreamDelta(content=text)
        self._buf += text
        head = self._buf.lstrip()
        if self._mode is None and head:
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._mode = "calls"
            elif not PYTHON_TAG.startswith(head):  # not (yet) the start of the tag either
                self._mode = "content"
                rest, self._buf = self._buf, ""
                return StreamDelta(content=rest)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        rest, self._buf = self._buf, ""
        parsed = self._parser.parse(rest)
        out = StreamDelta(content=parsed.content)
        for call in parsed.calls:
            self._emit(out, call)
        return out
