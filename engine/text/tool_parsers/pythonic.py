"""Pythonic calls (Llama 3.2 and 4, ToolACE): a Python list of calls with keyword arguments,
``[get_weather(city='San Francisco', unit='celsius'), get_time(timezone="UTC")]``.

Argument values are Python literals (strings, numbers, True / False / None, lists, tuples, dicts; JSON's
true / false / null are read too) and become JSON. One-line string values stream as they are written; others
are written once whole. As with ``llama3_json``, the format has no content before the calls: an output that
starts (after whitespace) with ``[`` is read as calls, any other streams as content. An output read as calls
whose first call is not a call of a known tool is content as written; so is everything from a later call's
``,`` if that call is not. Text after the list is content.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from engine.text.tool_parsers.base import ToolCallStream, ToolParser, arguments_json
from engine.text.tool_parsers.scan import WHITESPACE, ScanStream

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OCTAL = frozenset("01234567")
_ESCAPE_LENGTH = {"x": 4, "u": 6, "U": 10}  # an escape's length, backslash included
_JSON_WORDS: dict[str, Any] = {"true": True, "false": False, "null": None}
_CLOSES = {"(": ")", "[": "]", "{": "}"}
_QUOTES = "'\""
_BACKSLASH = "\\"


class PythonicToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return _PythonicStream(self)


def literal_json(text: str) -> str | None:
    """A Python (or JSON) literal's value as JSON text, or None when it is not one JSON can hold."""
    try:
        value = _JSON_WORDS[text] if text in _JSON_WORDS else ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        try:
            value = json.loads(text)
        except ValueError:
            return None
    try:
        return arguments_json(value, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _unescape(escape: str) -> str | None:
    """One backslash escape of a Python string literal, as text (None: not a valid escape)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unknown escape keeps its backslash, with a warning
        try:
            return str(ast.literal_eval('"' + escape + '"'))
        except (ValueError, SyntaxError):
            return None


def _json_body(text: str) -> str:
    return arguments_json(text)[1:-1]


class _PythonicStream(ScanStream):
    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self.state = "start"
        self.mark = 0  # until the start says calls or content
        self.name = ""
        self.kwargs = 0
        self.quote = ""  # the open string value's quote
        self.value: list[str] = []  # a value other than a one-line string, as read so far
        self.depth: list[str] = []  # its open brackets, and the quote of a string inside it

    def step(self, final: bool) -> bool:
        state = self.state
        if state == "content":
            self.content(self.buf[self.pos:])
            self.pos = len(self.buf)
            return False
        if state == "drop":
            self.pos = len(self.buf)
            return False
        if state == "string":
            return self._string()
        if state == "value":
            return self._value()
        if state == "tail":  # after the list: whitespace is layout, other text content
            self.state = "content"
            return True
        if not self.skip_ws():
            if final and state == "call" and self.calls_seen:
                self.mark = None  # a "," after the last call: layout
            return False
        c = self.buf[self.pos]
        if state == "start":
            if c != "[":
                self.pos, self.mark = 0, None
                self.state = "content"
                return True
            self.pos += 1
            self.state = "call"
            return True
        if state in ("call", "keyword"):
            return self._name(state, c, final)
        if state == "(":
            if c != "(" or not self.parser.is_tool(self.name):
                return self._fail_rest()
            self.pos += 1
            self.begin_call(self.name)
            self.arguments("{")
            self.kwargs = 0
            self.state = "keyword"
            return True
        if state == "=":
            if c != "=":
                return self._broken()
            self.pos += 1
            self.arguments((", " if self.kwargs else "") + arguments_json(self.name) + ": ")
            self.kwargs += 1
            self.state = "value start"
            return True
        if state == "value start":
            return self._value_start(c, final)
        if state == "after value":
            if c == ",":
                self.pos += 1
                self.state = "keyword"
                return True
            if c != ")":
                return self._broken()
            self.pos += 1
            return self._end_call()
        # after a call: "," and the next, "]", or (not the format) content
        if c == ",":
            self.mark = self.pos
            self.pos += 1
            self.state = "call"
        elif c == "]":
            self.pos += 1
            self.state = "tail"
        else:
            self.state = "content"
        return True

    def _name(self, state: str, c: str, final: bool) -> bool:
        """A call's function name, or a keyword argument's."""
        name = _NAME.match(self.buf, self.pos)
        if name is not None:
            if name.end() == len(self.buf) and not final:
                return False  # the name may go on
            self.name, self.pos = name.group(), name.end()
            self.state = "(" if state == "call" else "="
            return True
        if state == "keyword":
            if c != ")":
                return self._broken()  # a positional argument, or not Python
            self.pos += 1
            return self._end_call()
        if c == "]" and self.calls_seen:  # the list's trailing comma
            self.pos += 1
            self.mark = None
            self.state = "tail"
            return True
        return self._fail_rest()

    def _end_call(self) -> bool:
        self.arguments("}")
        self.end_call(True)
        self.state = "after call"
        return True

    def _broken(self) -> bool:
        """Not the format inside a call: the call ends there, and so do the calls (nothing resynchronizes)."""
        self.end_call(False)
        self.state = "drop"
        return True

    def _fail_rest(self) -> bool:
        self.pos = len(self.buf)
        self.fail()
        self.rest_is_content()
        return True

    def _value_start(self, c: str, final: bool) -> bool:
        if c in _QUOTES:
            opening = self.buf[self.pos:self.pos + 3]
            if len(opening) < 3 and not final:
                return False
            if not opening.startswith(c * 2):  # not a triple quote nor an empty string: streamed
                self.pos += 1
                self.quote = c
                self.arguments('"')
                self.state = "string"
                return True
        self.value, self.depth = [], []
        self.state = "value"
        return True

    def _string(self) -> bool:
        buf, quote, pos = self.buf, self.quote, self.pos
        out: list[str] = []
        closed = broken = False
        while pos < len(buf):
            c = buf[pos]
            if c == quote:
                pos += 1
                closed = True
                break
            if c == "\n":
                broken = True
                break
            if c != _BACKSLASH:
                stop = pos
                while stop < len(buf) and buf[stop] not in (quote, _BACKSLASH, "\n"):
                    stop += 1
                out.append(buf[pos:stop])
                pos = stop
                continue
            escape = self._escape(pos)
            if escape is None:
                break
            text = _unescape(escape)
            if text is None:
                broken = True
                break
            out.append(text)
            pos += len(escape)
        self.pos = pos
        self.arguments(_json_body("".join(out)) + ('"' if closed else ""))
        if broken:
            return self._broken()
        if closed:
            self.state = "after value"
        return closed

    def _escape(self, pos: int) -> str | None:
        """The backslash escape at ``pos``, or None while it may not be whole."""
        buf = self.buf
        if pos + 1 >= len(buf):
            return None
        kind = buf[pos + 1]
        if kind in _OCTAL:
            stop = pos + 1
            while stop < len(buf) and stop < pos + 4 and buf[stop] in _OCTAL:
                stop += 1
            return buf[pos:stop] if stop == pos + 4 or stop < len(buf) else None
        if kind == "N":
            close = buf.find("}", pos)
            return buf[pos:close + 1] if close >= 0 else None
        length = _ESCAPE_LENGTH.get(kind, 2)
        return buf[pos:pos + length] if pos + length <= len(buf) else None

    def _value(self) -> bool:
        """A value other than a one-line string: read to the "," or ")" after it, then read as a literal."""
        buf, pos, depth = self.buf, self.pos, self.depth
        while pos < len(buf):
            c = buf[pos]
            if depth and depth[-1] in _QUOTES:
                if c == _BACKSLASH:
                    if pos + 1 == len(buf):
                        break  # what it escapes has not arrived
                    pos += 1
                elif c == depth[-1]:
                    depth.pop()
            elif c in _QUOTES or c in _CLOSES:
                depth.append(c)
            elif c in ")]}" and depth:
                if _CLOSES[depth.pop()] != c:
                    return self._broken()
            elif c in ",)" and not depth:
                self.value.append(buf[self.pos:pos])
                self.pos = pos
                return self._literal()
            elif c in "]}":
                return self._broken()
            pos += 1
        self.value.append(buf[self.pos:pos])
        self.pos = pos
        return False

    def _literal(self) -> bool:
        value = literal_json("".join(self.value).strip(WHITESPACE))
        if value is None:
            return self._broken()
        self.arguments(value)
        self.state = "after value"
        return True
