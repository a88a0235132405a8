"""Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    San Francisco
    </parameter>
    </function>
    </tool_call>

A parameter's value is text, one newline either side trimmed, typed by the tool's JSON schema as vLLM types it:
``null`` (any case) is null; string parameters (and those the schema does not know) stay text and stream as
they are written; integer, number and boolean values are read as such, object and array values as JSON or a
Python literal, and a value that does not read as its type stays text. A value ends at ``</parameter>``, or
where the model left that out, at the next ``<parameter=`` or ``</function>``; ``</tool_call>`` ends the call.

Text outside the blocks is content. A block that does not open with ``<function=`` and a known tool's name is
content as written, end tag included. Inside a call, text between the tags that is not a tag is skipped, and
``</tool_call>`` closes the call even without ``</function>``.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from typing import Any

from engine.text.tool_parsers.base import ToolCallStream, ToolParser, arguments_json, partial_suffix
from engine.text.tool_parsers.scan import WHITESPACE, ScanStream

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})


class Qwen3CoderToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return _Qwen3CoderStream(self)

    def parameter_type(self, tool: str, parameter: str) -> str:
        """The JSON type a parameter's text is read as ("string" where the schema does not say)."""
        properties = self.parameters.get(tool, {}).get("properties")
        schema = properties.get(parameter) if isinstance(properties, Mapping) else None
        if not isinstance(schema, Mapping):
            return "string"
        types = schema.get("type")
        if types is None:
            options = [o for key in ("anyOf", "oneOf") for o in schema.get(key, ()) if isinstance(o, Mapping)]
            types = [o.get("type") for o in options]
        if not isinstance(types, list):
            types = [types]
        names = [str(t).strip().lower() for t in types if t is not None and t != "null"]
        if not names or any(t in _STRING_TYPES for t in names):
            return "string"
        return names[0]


def typed_value(text: str, kind: str) -> Any:
    """A non-string parameter's value read as ``kind``; the text itself where it does not read as one."""
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        try:
            return int(text)
        except ValueError:
            return number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        for read in (json.loads, ast.literal_eval):
            try:
                value = read(text)
                arguments_json(value, allow_nan=False)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                continue
            return value
    return text


def json_string_body(text: str) -> str:
    return arguments_json(text)[1:-1]


class _Qwen3CoderStream(ScanStream):
    parser: Qwen3CoderToolParser

    def __init__(self, parser: Qwen3CoderToolParser) -> None:
        super().__init__(parser)
        self.name = ""
        self.params = 0  # parameters written into the open call's arguments
        self.kind = "string"
        self.value = ""  # the value read and not yet written
        self.value_begun = False  # its first character (a newline to trim, or not) was read
        self.quoted = False  # a string value's opening quote is written: it is not null

    def step(self, final: bool) -> bool:
        if self.state == "content":
            if not self.content_until(START, final):
                return False
            self.mark = self.pos
            self.pos += len(START)
            self.state = "head"
            return True
        end, at_end = self.bounded(END, final)
        more = not (final or at_end)
        state = self.state
        if state == "value":
            return self._read_value(end, at_end, more)
        if state in ("name", "parameter name"):
            close = self.buf.find(">", self.pos, end)
            if close < 0:
                if not at_end:
                    return False
                return self._broken(end) if state == "parameter name" else self._not_a_call(end)
            name, self.pos = self.buf[self.pos:close].strip(WHITESPACE), close + 1
            if state == "parameter name":
                self._begin_value(name)
                return True
            if not self.parser.is_tool(name):
                self.state = "not a call"
                return True
            self.name = name
            self.begin_call(name)
            self.arguments("{")
            self.params = 0
            self.state = "parameters"
            return True
        if state == "not a call":  # held until its end tag
            return self._not_a_call(end) if at_end else False
        if state == "rest of the call":
            self.pos = end
            if at_end:
                self.pos += len(END)
                self.state = "content"
            return at_end
        if not self.skip_ws(end):
            if not at_end:
                return False
            if state == "head":
                return self._not_a_call(end)
            self._close_arguments()
            self.state = "rest of the call"
            return True
        if state == "head":
            found = self.starts(FUNCTION, end, more)
            if found is None:
                return False
            if not found:
                self.state = "not a call"
                return True
            self.pos += len(FUNCTION)
            self.state = "name"
            return True
        # between parameters
        for tag, then in ((PARAMETER, "parameter name"), (FUNCTION_END, "rest of the call")):
            found = self.starts(tag, end, more)
            if found is None:
                return False
            if found:
                self.pos += len(tag)
                if then == "rest of the call":
                    self._close_arguments()
                self.state = then
                return True
        self.pos += 1  # neither tag: not the format, and inside a call nothing else can be read
        return True

    def _not_a_call(self, end: int) -> bool:
        """The block, end tag included, is content as written."""
        assert self.mark is not None
        self.raw(self.buf[self.mark:end + len(END)])
        self.pos = end + len(END)
        self.state = "content"
        return True

    def _broken(self, end: int) -> bool:
        self.end_call(False)
        self.pos = end
        self.state = "rest of the call"
        return True

    def _close_arguments(self) -> None:
        self.arguments("}")
        self.end_call(True)

    def _begin_value(self, name: str) -> None:
        self.arguments((", " if self.params else "") + arguments_json(name) + ": ")
        self.params += 1
        self.kind = self.parser.parameter_type(self.name, name)
        self.value, self.value_begun, self.quoted = "", False, False
        self.state = "value"

    def _read_value(self, end: int, at_end: bool, more: bool) -> bool:
        stop, after = end, end
        for tag in _VALUE_ENDS:
            at = self.buf.find(tag, self.pos, end)
            if 0 <= at < stop:
                stop, after = at, at + len(tag) if tag == PARAMETER_END else at
        ended = stop < end or not more
        if not ended:  # hold back what may yet become a tag
            tail = self.buf[max(self.pos, end - len(PARAMETER_END)):end]
            stop = after = end - max(partial_suffix(tail, tag) for tag in _VALUE_ENDS)
        text, self.pos = self.buf[self.pos:stop], after
        if not self.value_begun and text:
            self.value_begun = True
            text = text[1:] if text[0] == "\n" else text
        self.value += text
        if not ended:
            if self.kind == "string":
                self._stream_string()
            return False
        if not more and stop == end and not at_end:
            return False  # the output ended inside the value: the call is cut there
        if self.value.endswith("\n"):
            self.value = self.value[:-1]
        self._write_value()
        self.state = "parameters"
        return True

    def _stream_string(self) -> None:
        """Writes what is sure of a string value: all but a last newline (trimmed if the value ends there),
        once the value can no longer be ``null``."""
        if not self.quoted:
            if len(self.value) <= len("null\n") and "null\n".startswith(self.value.lower()):
                return
            self.arguments('"')
            self.quoted = True
        keep = 1 if self.value.endswith("\n") else 0
        self.arguments(json_string_body(self.value[:len(self.value) - keep]))
        self.value = self.value[len(self.value) - keep:]

    def _write_value(self) -> None:
        if self.quoted:
            self.arguments(json_string_body(self.value) + '"')
        elif self.value.lower() == "null":
            self.arguments("null")
        elif self.kind == "string":
            self.arguments(arguments_json(self.value))
        else:
            self.arguments(arguments_json(typed_value(self.value, self.kind)))
        self.value = ""
