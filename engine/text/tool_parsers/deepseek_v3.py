"""DeepSeek-V3 and V3.1 calls, inside ``<｜tool▁calls▁begin｜>`` … ``<｜tool▁calls▁end｜>``, one per
``<｜tool▁call▁begin｜>`` … ``<｜tool▁call▁end｜>``:

* V3 (and R1-0528): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``;
* V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

Which one a call is shows after the separator: the arguments' ``{`` at once (V3.1) or a name (V3). Text
before the calls is content, and so is text after ``<｜tool▁calls▁end｜>``. A call that is not a call of a known
tool (another name, text that breaks the layout before its arguments begin) is content as written from its
``<｜tool▁call▁begin｜>`` (the first one: from ``<｜tool▁calls▁begin｜>``), and what follows it is read as content.
"""

from __future__ import annotations

from engine.text.tool_parsers.base import ToolCallStream, ToolParser
from engine.text.tool_parsers.json_reader import JsonReader
from engine.text.tool_parsers.scan import WHITESPACE, ScanStream

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"
_NAME_ENDS = frozenset("`{" + WHITESPACE)


class DeepSeekV3ToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return _DeepSeekStream(self)


class _DeepSeekStream(ScanStream):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self.calls_in_section = 0
        self.head = ""  # what came before the separator: V3's "function", or V3.1's name
        self.args = JsonReader("{")

    def step(self, final: bool) -> bool:
        state = self.state
        if state == "content":
            if not self.content_until(CALLS_BEGIN, final):
                return False
            self.mark = self.pos
            self.pos += len(CALLS_BEGIN)
            self.calls_in_section = 0
            self.state = "calls"
            return True
        if state == "calls":
            return self._between_calls(final)
        end, at_end = self.bounded(CALL_END, final)
        more = not (final or at_end)
        if state == "args":
            self.pos, text = self.args.feed(self.buf, self.pos, end)
            self.arguments(text)
            if not (self.args.done or self.args.failed or at_end):
                return False
            self.end_call(self.args.done)
            self.state = "rest of the call"
            return True
        if state == "rest of the call":  # after the arguments: V3's closing fence, then the end marker
            self.pos = end
            if at_end:
                self.pos += len(CALL_END)
                self.state = "calls"
            return at_end
        if state == "head":
            sep = self.buf.find(SEP, self.pos, end)
            if sep < 0:
                return self.fail() if at_end else False
            self.head, self.pos = self.buf[self.pos:sep].strip(WHITESPACE), sep + len(SEP)
            self.state = "after separator"
            return True
        if state == "name":
            stop = self.pos
            while stop < end and self.buf[stop] not in _NAME_ENDS:
                stop += 1
            if stop == end and more:
                return False
            return self._named(self.buf[self.pos:stop], stop)
        if not self.skip_ws(end):
            return self.fail() if at_end else False
        if state == "after separator":
            if self.buf[self.pos] == "{":
                return self._named(self.head, self.pos)
            self.state = "name"
            return True
        if state == "fence":  # V3's ```json before the arguments
            for fence in (FENCE + "json", FENCE):
                found = self.starts(fence, end, more)
                if found is None:
                    return False
                if found:
                    self.pos += len(fence)
                    break
            self.state = "arguments"
            return True
        if self.buf[self.pos] != "{":
            return self.fail()
        self._begin()
        return True

    def _between_calls(self, final: bool) -> bool:
        if not self.skip_ws():
            return False
        for marker in (CALL_BEGIN, CALLS_END):
            found = self.starts(marker, len(self.buf), not final)
            if found is None:
                return False
            if found:
                break
        else:  # other text: before any call the section is not calls; after them, it is content
            return self.fail() if self.calls_in_section == 0 else self._end_section()
        if self.calls_in_section and marker == CALL_BEGIN:
            self.mark = self.pos
        self.pos += len(marker)
        if marker == CALL_BEGIN:
            self.state = "head"
            return True
        return self.fail() if self.calls_in_section == 0 else self._end_section()

    def _named(self, name: str, pos: int) -> bool:
        self.pos = pos
        if not self.parser.is_tool(name):
            return self.fail()
        self.head = name
        if self.buf.startswith("{", pos):
            self._begin()
        else:
            self.state = "fence"
        return True

    def _begin(self) -> None:
        self.begin_call(self.head)
        self.calls_in_section += 1
        self.args = JsonReader("{")
        self.state = "args"

    def _end_section(self) -> bool:
        self.mark = None
        self.to_content()
        return True
