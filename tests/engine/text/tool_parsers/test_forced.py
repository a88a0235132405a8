"""engine/text/tool_parsers/forced.py: reading back outputs tool_choice "required" or a named function constrained."""

from __future__ import annotations

import pytest

from engine.text.tool_parsers import NamedToolParser, ParsedCall, ParsedOutput, RequiredToolParser
from tests.engine.text.tool_parsers.streaming import assert_every_chunking_matches, streamed

TOOLS = ("get_current_weather", "get_time")

CASES = {
    "one": ('[{"name": "get_time", "parameters": {"timezone": "UTC"}}]',
            ParsedOutput("", (ParsedCall("get_time", '{"timezone": "UTC"}'),))),
    "two": ('[{"name": "get_time", "parameters": {}}, {"name": "get_current_weather", "parameters": '
            '{"location": "Oslo"}}]',
            ParsedOutput("", (ParsedCall("get_time", "{}"),
                              ParsedCall("get_current_weather", '{"location": "Oslo"}')))),
    "cut short": ('[{"name": "get_time", "parameters": {"time',
                  ParsedOutput('[{"name": "get_time", "parameters": {"time')),
    "empty array": ("[]", ParsedOutput("[]")),
    "unknown name": ('[{"name": "rm", "parameters": {}}]', ParsedOutput('[{"name": "rm", "parameters": {}}]')),
}


@pytest.mark.parametrize("name", list(CASES))
def test_required_parse_and_stream_agree(name: str) -> None:
    text, expected = CASES[name]
    assert_every_chunking_matches(RequiredToolParser(TOOLS), text, expected)


def test_named_output_is_the_call_arguments_streamed_as_fragments() -> None:
    parser = NamedToolParser("get_time")
    text = '{"timezone": "Asia/Tokyo"}'
    assert_every_chunking_matches(parser, text, ParsedOutput("", (ParsedCall("get_time", text),)))
    stream = parser.stream()
    first, second = stream.feed('{"time'), stream.feed('zone": "UTC"}')
    assert first.calls[0].id.startswith("call_") and first.calls[0].name == "get_time"
    assert first.calls[0].arguments == '{"time'
    assert (second.calls[0].id, second.calls[0].name, second.calls[0].arguments) == ("", "", 'zone": "UTC"}')
    assert stream.finish().calls == []


def test_named_empty_output_is_still_one_call() -> None:
    assert streamed(NamedToolParser("get_time"), [""]) == ParsedOutput("", (ParsedCall("get_time", ""),))
