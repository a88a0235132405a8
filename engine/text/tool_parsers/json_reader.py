"""JSON inside tool calls, read as it arrives.

``JsonReader`` reads one JSON value from text fed in pieces, checks every character as it comes, and writes
the value back in one layout: no whitespace but json.dumps' default ``", "`` and ``": "``, with strings,
numbers and literals as the model wrote them (escapes included). A call's arguments can then be sent while
they are written, the text sent is always the start of valid JSON, and its fragments join to the same text
however the output was cut into pieces.

``CallObjectReader`` reads a call written as one JSON object, ``{"name": ..., "arguments": {...}}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

_WS = frozenset(" \t\n\r")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_START = frozenset("-0123456789")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonReader:
    """One JSON value. ``first``: the character it must start with (``"{"``: an object), or None for any."""

    def __init__(self, first: str | None = None) -> None:
        self.first = first
        self.started = False  # its first character was read
        self.done = False
        self.failed = False
        self._stack: list[str] = []  # the open "{" and "["
        self._state = "value"
        self._token = ""  # a number or literal being read: written once it ends
        self._hex_left = 0
        self._in_key = False

    def feed(self, text: str, pos: int = 0, end: int | None = None) -> tuple[int, str]:
        """Reads ``text[pos:end]`` until the value ends (or fails, at the offending character); returns where
        it stopped and the value's text read, in the layout above."""
        end = len(text) if end is None else end
        out: list[str] = []
        while pos < end and not (self.done or self.failed):
            c = text[pos]
            state = self._state
            if state == "string":
                run = _STRING_RUN.match(text, pos, end)
                if run is not None:
                    out.append(run.group())
                    pos = run.end()
                elif c == '"':
                    out.append(c)
                    pos += 1
                    if self._in_key:
                        self._state = "colon"
                    else:
                        self._end_value()
                elif c == "\\":
                    out.append(c)
                    pos += 1
                    self._state = "escape"
                else:
                    self.failed = True  # a raw control character
            elif c in _WS and state not in ("number", "literal", "escape", "hex"):
                pos += 1
            elif state == "value":
                if self.first is not None and not self.started and c != self.first:
                    self.failed = True
                    break
                self.started = True
                pos += 1
                if c in "{[":
                    self._stack.append(c)
                    out.append(c)
                    self._state = "object_first" if c == "{" else "array_first"
                elif c == '"':
                    out.append(c)
                    self._in_key = False
                    self._state = "string"
                elif c in _NUMBER_START:
                    self._token, self._state = c, "number"
                elif c in "tfn":
                    self._token, self._state = c, "literal"
                else:
                    pos -= 1
                    self.failed = True
            elif state in ("object_first", "object_key"):
                if c == '"':
                    out.append(c)
                    pos += 1
                    self._in_key = True
                    self._state = "string"
                elif c == "}" and state == "object_first":
                    pos += 1
                    self._close(out, c)
                else:
                    self.failed = True
            elif state == "colon":
                if c == ":":
                    out.append(": ")
                    pos += 1
                    self._state = "value"
                else:
                    self.failed = True
            elif state == "array_first":
                if c == "]":
                    pos += 1
                    self._close(out, c)
                else:
                    self._state = "value"
            elif state == "after":
                if c == ",":
                    out.append(", ")
                    pos += 1
                    self._state = "object_key" if self._stack[-1] == "{" else "value"
                elif c == ("}" if self._stack[-1] == "{" else "]"):
                    pos += 1
                    self._close(out, c)
                else:
                    self.failed = True
            elif state == "escape":
                if c in _ESCAPES:
                    self._state = "string"
                elif c == "u":
                    self._hex_left, self._state = 4, "hex"
                else:
                    self.failed = True
                    break
                out.append(c)
                pos += 1
            elif state == "hex":
                if c not in _HEX:
                    self.failed = True
                    break
                out.append(c)
                pos += 1
                self._hex_left -= 1
                if not self._hex_left:
                    self._state = "string"
            elif state == "number":
                if c in _NUMBER_CHARS:
                    self._token += c
                    pos += 1
                elif _NUMBER.fullmatch(self._token):
                    out.append(self._token)
                    self._end_value()
                else:
                    self.failed = True
            else:  # literal
                if "a" <= c <= "z":
                    self._token += c
                    pos += 1
                    if not any(word.startswith(self._token) for word in _LITERALS):
                        pos -= 1
                        self.failed = True
                elif self._token in _LITERALS:
                    out.append(self._token)
                    self._end_value()
                else:
                    self.failed = True
        return pos, "".join(out)

    def _close(self, out: list[str], bracket: str) -> None:
        self._stack.pop()
        out.append(bracket)
        self._end_value()

    def _end_value(self) -> None:
        if self._stack:
            self._state = "after"
        else:
            self.done = True


class CallObjectReader:
    """A call written as one JSON object: its name under ``"name"``, its arguments (an object) under the first
    of ``args_keys`` present; other keys are read and ignored. ``is_tool`` says whether a name is a request's
    tool: any other name fails the reader right after it, as does an object that closes without a name.

    The arguments' text is kept for ``take_arguments`` (``"{}"`` when the object closes without them), so
    that a stream can send it from the moment the call is made: its name read and its arguments begun.
    """

    def __init__(self, args_keys: tuple[str, ...], is_tool: Callable[[str], bool]) -> None:
        self.args_keys = args_keys
        self.is_tool = is_tool
        self.name: str | None = None
        self.args_started = False
        self.args_done = False
        self.done = False
        self.failed = False
        self._state = "open"
        self._reader = JsonReader()
        self._role = ""  # what the value being read is: "key", "name", "arguments" or "other"
        self._text = ""  # the key or name read so far
        self._key = ""
        self._args: list[str] = []

    def take_arguments(self) -> str:
        if self.done and not self.args_started:
            self.args_started = self.args_done = True
            return "{}"
        text = "".join(self._args)
        self._args.clear()
        return text

    def feed(self, text: str, pos: int = 0, end: int | None = None) -> int:
        """Reads ``text[pos:end]`` until the object ends or fails; returns where it stopped."""
        end = len(text) if end is None else end
        while pos < end and not (self.done or self.failed):
            c = text[pos]
            state = self._state
            if state in ("key", "value"):
                pos = self._read_value(text, pos, end)
            elif c in _WS:
                pos += 1
            elif state == "open":
                self._expect(c == "{", "first_key")
                pos += 1
            elif state in ("first_key", "next_key"):
                if c == '"':
                    self._start("key", JsonReader('"'))
                elif c == "}" and state == "first_key":
                    pos = self._close(pos)
                else:
                    self.failed = True
            elif state == "colon":
                self._expect(c == ":", "value_start")
                pos += 1
            elif state == "value_start":
                if self._key == "name" and self.name is None:
                    self._start("name", JsonReader('"'))
                elif self._key in self.args_keys and not self.args_started:
                    self._start("arguments", JsonReader("{"))
                else:
                    self._start("other", JsonReader())
            else:  # after a value
                if c == ",":
                    self._state = "next_key"
                    pos += 1
                elif c == "}":
                    pos = self._close(pos)
                else:
                    self.failed = True
        return pos

    def _expect(self, ok: bool, state: str) -> None:
        if ok:
            self._state = state
        else:
            self.failed = True

    def _start(self, role: str, reader: JsonReader) -> None:
        self._role, self._reader, self._text = role, reader, ""
        self._state = "key" if role == "key" else "value"

    def _read_value(self, text: str, pos: int, end: int) -> int:
        reader, role = self._reader, self._role
        pos, read = reader.feed(text, pos, end)
        if role == "arguments":
            self.args_started = self.args_started or reader.started
            self._args.append(read)
        elif role in ("key", "name"):
            self._text += read
        if reader.failed:
            self.failed = True
        elif reader.done:
            if role == "key":
                self._key, self._state = json.loads(self._text), "colon"
                return pos
            if role == "name":
                name = json.loads(self._text)
                if not self.is_tool(name):
                    self.failed = True
                    return pos
                self.name = name
            self.args_done = self.args_done or role == "arguments"
            self._state = "after"
        return pos

    def _close(self, pos: int) -> int:
        if self.name is None:
            self.failed = True  # an object, but not a call
        else:
            self.done = True
        return pos + 1
