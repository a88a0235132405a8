"""The stream the model families' parsers share: a state machine reads the output from a buffer as it
arrives, and a call is sent as it is read: a header (id and name) once the call is made, then its arguments
in fragments.

A call is *made* once its name is read and is one of the request's tools, and its arguments have begun.
Until then its text is held: if it turns out not to be a call (another name, text that breaks the format)
that text is content, as written. From then on the call is the client's, since what was sent cannot be taken
back: if its arguments break off (max_tokens, or text that is not their syntax), the call ends there with the
arguments sent so far (``calls_whole`` turns false), and the rest of its text, up to the format's end of a
call, is dropped. Whitespace between and after calls is layout, not content; other text after a call is.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import TYPE_CHECKING

from engine.text.tool_parsers.base import StreamDelta, ToolCallDelta, ToolCallStream, new_call_id, partial_suffix

if TYPE_CHECKING:
    from engine.text.tool_parsers.base import ToolParser
    from engine.text.tool_parsers.json_reader import CallObjectReader

WHITESPACE = " \t\r\n"


class ScanStream(ToolCallStream):
    """``buf[pos:]`` is the text not yet read; ``mark`` is where the text of a call not yet made began."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser.max_calls)
        self.parser = parser
        self.calls_whole = True
        self.buf = ""
        self.pos = 0
        self.mark: int | None = None
        self.in_call = False  # a call is made (sent, or past max_calls) and has not ended
        self.args_complete = False  # the open call's arguments are whole
        self.calls_seen = 0  # calls the model made, those past max_calls included
        self._out = StreamDelta()
        self._sending = False
        self._gap_ws = ""  # whitespace after a call: layout, unless other text follows it
        self._gap_has_text = False
        self.state = "content"

    @abstractmethod
    def step(self, final: bool) -> bool:
        """Reads on from ``pos``; False when it cannot go on without more text (``final``: there is none)."""

    def feed(self, text: str) -> StreamDelta:
        keep = self.pos if self.mark is None else min(self.pos, self.mark)
        self.buf = self.buf[keep:] + text
        self.pos -= keep
        if self.mark is not None:
            self.mark -= keep
        while self.step(final=False):
            pass
        return self._take()

    def finish(self) -> StreamDelta:
        while self.step(final=True):
            pass
        if self.in_call:
            self.end_call(self.args_complete)
        elif self.mark is not None:
            self.raw(self.buf[self.mark:])
        self.buf, self.pos, self.mark = "", 0, None
        return self._take()

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    # ---- what the text turned into ------------------------------------------------------------------

    def content(self, text: str) -> None:
        if not text:
            return
        if self.calls_seen and not self._gap_has_text:
            if not text.strip(WHITESPACE):
                self._gap_ws += text
                return
            text, self._gap_ws, self._gap_has_text = self._gap_ws + text, "", True
        self._out.content += text

    def raw(self, text: str) -> None:
        """The held text of what turned out not to be a call: content as written."""
        self._gap_ws, self._gap_has_text = "", False
        self._out.content += text
        self.mark = None

    def fail(self) -> bool:
        """What was held since ``mark`` is content; reading goes on from ``pos`` as content."""
        assert self.mark is not None
        self.raw(self.buf[self.mark:self.pos])
        self.to_content()
        return True

    def rest_is_content(self) -> None:
        """Where nothing can resynchronize: what follows is content as written, whitespace too."""
        self._gap_has_text = True

    def to_content(self) -> None:
        """Subclasses' content state: reading text outside calls."""
        self.state = "content"

    def begin_call(self, name: str) -> None:
        self.mark = None
        self.calls_seen += 1
        self._gap_ws, self._gap_has_text = "", False
        self.in_call, self.args_complete = True, False
        self._sending = self.max_calls is None or self.calls_made < self.max_calls
        if self._sending:
            self._out.calls.append(ToolCallDelta(self.calls_made, new_call_id(), name))
            self.calls_made += 1

    def arguments(self, text: str) -> None:
        if not (self._sending and text):
            return
        calls = self._out.calls
        if calls and calls[-1].index == self.calls_made - 1:
            calls[-1] = dataclasses.replace(calls[-1], arguments=calls[-1].arguments + text)
        else:
            calls.append(ToolCallDelta(self.calls_made - 1, arguments=text))

    def end_call(self, complete: bool) -> None:
        if self._sending and not complete:
            self.calls_whole = False
        self.in_call = self._sending = False

    # ---- reading the buffer ---------------------------------------------------------------------------

    def content_until(self, marker: str, final: bool) -> bool:
        """Content up to ``marker``; True with ``pos`` at it, False when it is not (yet) there."""
        at = self.buf.find(marker, self.pos)
        if at < 0:
            end = len(self.buf) if final else max(self.pos, len(self.buf) - partial_suffix(self.buf, marker))
            self.content(self.buf[self.pos:end])
            self.pos = end
            return False
        self.content(self.buf[self.pos:at])
        self.pos = at
        return True

    def bounded(self, marker: str, final: bool) -> tuple[int, bool]:
        """Where the text that can still belong to this call ends: at ``marker`` (True), or at what has arrived,
        less an end that may yet become the marker (False)."""
        at = self.buf.find(marker, self.pos)
        if at >= 0:
            return at, True
        if final:
            return len(self.buf), False
        return max(self.pos, len(self.buf) - partial_suffix(self.buf, marker)), False

    def skip_ws(self, end: int | None = None) -> bool:
        """Moves past whitespace; True when another character follows before ``end``."""
        end = len(self.buf) if end is None else end
        buf, pos = self.buf, self.pos
        while pos < end and buf[pos] in WHITESPACE:
            pos += 1
        self.pos = pos
        return pos < end

    def starts(self, word: str, end: int, more: bool) -> bool | None:
        """Whether ``word`` is at ``pos``: None while what is there is only its start and ``more`` may come."""
        there = self.buf[self.pos:min(end, self.pos + len(word))]
        if there == word:
            return True
        return None if more and word.startswith(there) else False

    def read_call(self, reader: CallObjectReader, end: int) -> str | None:
        """Feeds a call written as a JSON object up to ``end``: "closed" (a whole call read), "broken" (a call
        made whose text then went wrong: it ended there), "failed" (not a call: nothing sent, ``pos`` where it
        went wrong) or None (more text needed)."""
        self.pos = reader.feed(self.buf, self.pos, end)
        if not self.in_call and reader.name is not None and (reader.args_started or reader.done):
            self.begin_call(reader.name)
        if self.in_call:
            self.arguments(reader.take_arguments())
            self.args_complete = reader.args_done
        if reader.failed:
            if not self.in_call:
                return "failed"
            self.end_call(reader.args_done)
            return "broken"
        if reader.done:
            self.end_call(True)
            return "closed"
        return None
