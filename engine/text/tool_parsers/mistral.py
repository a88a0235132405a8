"""Mistral calls, after the ``[TOOL_CALLS]`` token, in either of mistral-common's two layouts:

* tokenizers before v11 (Mistral-7B-Instruct-v0.3, Mixtral, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments":
  {...}, "id": ...}, ...]``, one JSON array of calls;
* v11 and later (Mistral-Small-3.1+, Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}``, once per call, with
  ``[CALL_ID]id`` before ``[ARGS]`` in v11 (and ``[ARGS]`` absent where a decoder dropped it).

Text before the token is content. A call that is not a call of a known tool (another name, text that breaks
the layout before its arguments begin) is content as written, and what follows it is read as content again.
A ``[TOOL_CALLS]`` ends the call before it. The markers are special tokens: the tokenizer service keeps them
in the text for this parser (``keeps_special_tokens``).
"""

from __future__ import annotations

from engine.text.tool_parsers.base import ToolCallStream, ToolParser
from engine.text.tool_parsers.json_reader import CallObjectReader, JsonReader
from engine.text.tool_parsers.scan import WHITESPACE, ScanStream

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME_ENDS = frozenset("[{" + WHITESPACE)


class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    def stream(self) -> ToolCallStream:
        return _MistralStream(self)


class _MistralStream(ScanStream):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self.name = ""
        self.args = JsonReader("{")
        self.reader = CallObjectReader(("arguments",), parser.is_tool)
        self.first_item = True

    def step(self, final: bool) -> bool:
        if self.state == "content":
            if not self.content_until(TOOL_CALLS, final):
                return False
            self.mark = self.pos
            self.pos += len(TOOL_CALLS)
            self.state = "head"
            return True
        end, at_end = self.bounded(TOOL_CALLS, final)
        state = self.state
        if state == "drop":
            self.pos = end
            if at_end:
                self.state = "content"
            return at_end
        if state == "args":
            self.pos, text = self.args.feed(self.buf, self.pos, end)
            self.arguments(text)
            if not (self.args.done or self.args.failed or at_end):
                return False
            self.end_call(self.args.done)
            self.state = "drop" if self.args.failed else "content"
            return True
        if state == "object":
            return self._read_item(end, at_end)
        if state == "name":
            stop = self.pos
            while stop < end and self.buf[stop] not in _NAME_ENDS:
                stop += 1
            if stop == end and not at_end:
                return False
            self.name, self.pos = self.buf[self.pos:stop], stop
            if not self.parser.is_tool(self.name):
                return self.fail()
            self.state = "name end"
            return True
        if state == "call id":
            while self.pos < end and self.buf[self.pos] not in "[{":
                self.pos += 1
            if self.pos == end:
                return self.fail() if at_end else False
            self.state = "name end"
            return True
        if not self.skip_ws(end):
            if not at_end:
                return False
            if self.mark is None:  # after a call: the next [TOOL_CALLS] ends the array
                self.to_content()
                return True
            return self.fail()
        c = self.buf[self.pos]
        if state == "head":  # an array (before v11), or a name
            self.state = "name"
            if c == "[":
                self.pos += 1
                self.state, self.first_item = "item", True
            return True
        if state == "name end":
            for marker, then in ((ARGS, "args start"), (CALL_ID, "call id")):
                found = self.starts(marker, end, not (final or at_end))
                if found is None:
                    return False
                if found:
                    self.pos += len(marker)
                    self.state = then
                    return True
            if c != "{":
                return self.fail()
            self.state = "args start"
            return True
        if state == "args start":
            if c != "{":
                return self.fail()
            self.begin_call(self.name)
            self.args = JsonReader("{")
            self.state = "args"
            return True
        if state == "item":  # an array's next call, or its end after a trailing comma
            if c == "{":
                self.reader = CallObjectReader(("arguments",), self.parser.is_tool)
                self.state = "object"
                return True
            if c == "]" and not self.first_item:
                self.pos += 1
                self.mark = None
                self.to_content()
                return True
            return self.fail()
        # after an array's call: "," and the next, "]", or (not the format) content
        if c == ",":
            self.mark = self.pos
            self.pos += 1
            self.first_item = False
            self.state = "item"
            return True
        if c == "]":
            self.pos += 1
        self.to_content()
        return True

    def _read_item(self, end: int, at_end: bool) -> bool:
        result = self.read_call(self.reader, end)
        if result is None:
            if not at_end:
                return False
            if not self.in_call:
                return self.fail()
            self.end_call(self.reader.args_done)
            self.to_content()
            return True
        if result == "failed":
            return self.fail()
        self.state = "after item" if result == "closed" else "drop"
        return True
