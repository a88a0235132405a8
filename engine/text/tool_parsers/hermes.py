"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text outside the tags is content; several calls may follow each other. A block's end tag ends it, even inside
a JSON string (as vLLM reads it). A block that is not a call of a known tool (bad JSON before the arguments
begin, another name, no name, arguments that are not an object) is content as written, end tag included,
as is a block the output ends in before its call is made (see scan.py).
"""

from __future__ import annotations

from engine.text.tool_parsers.base import ToolCallStream, ToolParser
from engine.text.tool_parsers.json_reader import CallObjectReader
from engine.text.tool_parsers.scan import ScanStream

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return _HermesStream(self)


class _HermesStream(ScanStream):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self.reader = CallObjectReader(("arguments",), parser.is_tool)

    def step(self, final: bool) -> bool:
        if self.state == "content":
            if not self.content_until(START, final):
                return False
            self.mark = self.pos
            self.pos += len(START)
            self.reader = CallObjectReader(("arguments",), self.parser.is_tool)
            self.state = "call"
            return True
        end, at_end = self.bounded(END, final)
        if self.state == "call":
            result = self.read_call(self.reader, end)
            if result is None and at_end:  # the block ended inside the object
                if self.in_call:
                    self.end_call(self.reader.args_done)
                result = "broken" if self.mark is None else "failed"
            if result is None:
                return False
            self.state = "not a call" if result == "failed" else "rest of the call"
            return True
        if not at_end:  # the end tag is not there yet
            if self.state == "rest of the call":
                self.pos = end
            return False
        if self.state == "not a call":
            assert self.mark is not None
            self.raw(self.buf[self.mark:end + len(END)])
        self.pos = end + len(END)
        self.state = "content"
        return True
