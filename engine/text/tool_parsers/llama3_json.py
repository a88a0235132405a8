"""Llama 3.1/3.2 JSON calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
several separated by ``;``.

The format has no content before calls: an output that starts (after whitespace) with ``{`` or the tag is
read as calls, any other streams as content. An output read as calls whose first call is not a call of a
known tool (or not JSON before its arguments begin) is content as written; so is everything from a later
``;`` whose call is not. Text after a call that is neither whitespace nor ``;`` and a call is content.
"""

from __future__ import annotations

from engine.text.tool_parsers.base import ToolCallStream, ToolParser
from engine.text.tool_parsers.json_reader import CallObjectReader
from engine.text.tool_parsers.scan import WHITESPACE, ScanStream

PYTHON_TAG = "<|python_tag|>"
# Llama's own key is "parameters"; some fine-tunes write "arguments".
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return _Llama3Stream(self)


class _Llama3Stream(ScanStream):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self.state = "start"
        self.mark = 0  # until the start says calls or content
        self.reader = CallObjectReader(ARGUMENT_KEYS, parser.is_tool)

    def step(self, final: bool) -> bool:
        state = self.state
        if state == "content":
            self.content(self.buf[self.pos:])
            self.pos = len(self.buf)
            return False
        if state == "drop":
            self.pos = len(self.buf)
            return False
        if state == "call":
            result = self.read_call(self.reader, len(self.buf))
            if result is None:
                return False
            if result == "failed":
                return self.fail_rest()
            self.state = "after" if result == "closed" else "drop"
            return True
        if state == "after":  # a call ended: whitespace, then ";" and a call, or content
            rest = len(self.buf) - len(self.buf[self.pos:].lstrip(WHITESPACE))
            if rest == len(self.buf):
                return False
            if self.buf[rest] != ";":
                self.state = "content"
                return True
            self.mark, self.pos, self.state = rest, rest + 1, "item"
            return True
        if not self.skip_ws():
            if final and state == "item" and self.calls_seen:
                self.mark = None  # a ";" after the last call: layout
            return False
        if state == "start":
            tag = self.starts(PYTHON_TAG, len(self.buf), not final)
            if tag is None:
                return False
            if tag:
                self.pos += len(PYTHON_TAG)
            elif self.buf[self.pos] != "{":
                self.pos, self.mark = 0, None
                self.state = "content"
                return True
            self.state = "item"
            return True
        # an item: a call's object
        if self.buf[self.pos] != "{":
            return self.fail_rest()
        self.reader = CallObjectReader(ARGUMENT_KEYS, self.parser.is_tool)
        self.state = "call"
        return True

    def fail_rest(self) -> bool:
        """No resynchronizing in this format: everything from the mark on is content."""
        self.pos = len(self.buf)
        self.fail()
        self.rest_is_content()
        return True
