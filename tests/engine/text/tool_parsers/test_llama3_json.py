"""engine/text/tool_parsers/llama3_json.py on texts Llama-3.1-8B-Instruct wrote (and ways they go wrong)."""

from __future__ import annotations

import pytest

from engine.text.tool_parsers import Llama3JsonToolParser, ParsedCall, ParsedOutput
from tests.engine.text.tool_parsers.streaming import assert_every_chunking_matches

TOOLS = ("get_current_weather", "get_time")
PARIS = '{"name": "get_current_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}'
TOKYO = '{"name": "get_time", "parameters": {"timezone": "Asia/Tokyo"}}'
PARIS_CALL = ParsedCall("get_current_weather", '{"location": "Paris, France", "unit": "celsius"}')
TOKYO_CALL = ParsedCall("get_time", '{"timezone": "Asia/Tokyo"}')

CASES = {
    "single": (PARIS, ParsedOutput("", (PARIS_CALL,))),
    "multiple": (f"{PARIS}; {TOKYO}", ParsedOutput("", (PARIS_CALL, TOKYO_CALL))),
    "python_tag": (f"<|python_tag|>{TOKYO}", ParsedOutput("", (TOKYO_CALL,))),
    "python_tag, multiple, whitespace": (f"\n<|python_tag|>{PARIS};\n{TOKYO}\n",
                                         ParsedOutput("", (PARIS_CALL, TOKYO_CALL))),
    "arguments key": ('{"name": "get_time", "arguments": {"timezone": "UTC"}}',
                      ParsedOutput("", (ParsedCall("get_time", '{"timezone": "UTC"}'),))),
    "plain answer": ("It is 9 am in Tokyo.", ParsedOutput("It is 9 am in Tokyo.")),
    "malformed": ('{"name": "get_time", "parameters": {"timezone": "UTC"}',
                  ParsedOutput('{"name": "get_time", "parameters": {"timezone": "UTC"}')),
    "a good call then garbage": (f"{PARIS}; and then", ParsedOutput(f"{PARIS}; and then")),
    "unknown name": ('{"name": "send_email", "parameters": {}}',
                     ParsedOutput('{"name": "send_email", "parameters": {}}')),
    "JSON that is not a call": ('{"temperature": 21}', ParsedOutput('{"temperature": 21}')),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parse_and_every_chunking_of_the_stream_agree(name: str) -> None:
    text, expected = CASES[name]
    assert_every_chunking_matches(Llama3JsonToolParser(TOOLS), text, expected)


def test_a_plain_answer_streams_as_it_comes() -> None:
    stream = Llama3JsonToolParser(TOOLS).stream()
    assert stream.feed(" ").content == ""  # whitespace alone does not say which
    assert stream.feed("It").content == " It"
    assert stream.feed(" is").content == " is"
    assert stream.finish().content == "" and stream.calls_made == 0
