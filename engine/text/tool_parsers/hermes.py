"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text outside the tags is content; several calls may follow each other. Whitespace between calls and after
the last one is the model's layout, not content. A block that is not a valid call of a known tool (bad
JSON, unknown name, no closing tag) stays in the content as written.
"""

from __future__ import annotations

import json

from engine.text.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    StreamDelta,
    ToolCallStream,
    ToolParser,
    partial_suffix,
)

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            gap = text[pos:] if start < 0 else text[pos:start]
            if not calls or gap.strip():
                content.append(gap)
            if start < 0:
                break
            end = text.find(END, start + len(START))
            if end < 0:
                content.append(text[start:])
                break
            call = self.call(text[start + len(START):end])
            if call is None:
                content.append(text[start:end + len(END)])
            else:
                calls.append(call)
            pos = end + len(END)
        return self._limit("".join(content), calls)

    def call(self, body: str) -> ParsedCall | None:
        """The call a block's JSON makes, or None when it is not a valid call of a known tool."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        return self.known_call(obj.get("name"), obj.get("arguments", {}))

    def stream(self) -> ToolCallStream:
        return _HermesStream(self)


class _HermesStream(ToolCallStream):
    def __init__(self, parser: HermesToolParser) -> None:
        super().__init__(parser.max_calls)
        self._parser = parser
        self._buf = ""  # text not yet decided
        self._in_call = False
        self._valid_calls = 0  # made by the model, including those max_calls drops
        self._gap_has_text = False  # the text since the last block has more than whitespace

    def _keeps_gap(self, gap: str) -> bool:
        return not self._valid_calls or self._gap_has_text or bool(gap.strip())

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        out = StreamDelta()
        while True:
            if not self._in_call:
                start = self._buf.find(START)
                if start < 0:
                    ready = self._buf[: len(self._buf) - partial_suffix(self._buf, START)]
                    if self._keeps_gap(ready):
                        out.content += ready
                        self._gap_has_text = self._gap_has_text or bool(ready.strip())
                        self._buf = self._buf[len(ready):]
                    return out
                if self._keeps_gap(self._buf[:start]):
                    out.content += self._buf[:start]
                self._buf = self._buf[start:]
                self._in_call = True
            else:
                end = self._buf.find(END, len(START))
                if end < 0:
                    return out
                block = self._buf[: end + len(END)]
                call = self._parser.call(block[len(START):-len(END)])
                if call is None:
                    out.content += block
                else:
                    self._valid_calls += 1
                    self._emit(out, call)
                self._buf = self._buf[len(block):]
                self._in_call = False
                self._gap_has_text = False

    def finish(self) -> StreamDelta:
        rest, self._buf = self._buf, ""
        return StreamDelta(content=rest if self._in_call or self._keeps_gap(rest) else "")
