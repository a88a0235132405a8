"""engine/text/tool_parsers/qwen3_coder.py: values typed by the schema, and string values streamed."""

from __future__ import annotations

import pytest

from engine.text.tool_parsers import Qwen3CoderToolParser, ToolCallDelta
from engine.text.tool_parsers.qwen3_coder import typed_value

SCHEMA = {"f": {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"},
                                                 "maybe": {"type": ["null", "number"]}, "any": {}}}}


def parser() -> Qwen3CoderToolParser:
    return Qwen3CoderToolParser(("f",), parameters=SCHEMA)


def test_parameter_types_come_from_the_schema() -> None:
    p = parser()
    assert [p.parameter_type("f", name) for name in ("text", "n", "maybe", "any", "unknown")] == \
        ["string", "integer", "number", "string", "string"]
    assert p.parameter_type("g", "x") == "string"  # a tool without a schema


@pytest.mark.parametrize(("text", "kind", "value"), [
    ("12", "integer", 12), ("1.5", "integer", "1.5"), ("1.5", "number", 1.5), ("2", "number", 2),
    ("nan", "number", "nan"), ("FALSE", "boolean", False), ("yes", "boolean", "yes"),
    ('{"a": [1]}', "object", {"a": [1]}), ("{'a': (1, 2)}", "object", {"a": (1, 2)}), ("{1, 2}", "array", "{1, 2}"),
    ("x", "string", "x"),
])
def test_a_value_reads_as_its_type_or_stays_text(text: str, kind: str, value: object) -> None:
    assert typed_value(text, kind) == value


def test_a_string_value_streams_as_written_and_a_possible_null_is_held() -> None:
    stream = parser().stream()
    head = stream.feed("<tool_call>\n<function=f>\n<parameter=text>\nnu").calls
    assert [(c.name, c.arguments) for c in head] == [("f", '{"text": ')]  # "nu" may be null
    assert stream.feed("mbers:\n1").calls == [ToolCallDelta(0, arguments='"numbers:\\n1')]
    assert stream.feed("\n").calls == []  # the last newline is trimmed if the value ends there
    assert stream.feed("2\n</param").calls == [ToolCallDelta(0, arguments="\\n2")]
    assert stream.feed('eter>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>').calls == \
        [ToolCallDelta(0, arguments='", "n": 7}')]
    assert stream.finish().calls == [] and stream.calls_whole
