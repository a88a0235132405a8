"""engine/text/tool_parsers/hermes.py on texts Qwen2.5-7B-Instruct wrote (and ways they go wrong)."""

from __future__ import annotations

import pytest

from engine.text.tool_parsers import HermesToolParser, ParsedCall, ParsedOutput
from tests.engine.text.tool_parsers.streaming import assert_every_chunking_matches

TOOLS = ("get_current_weather", "get_time")
PARIS = '{"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}'
TOKYO = '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}'
PARIS_CALL = ParsedCall("get_current_weather", '{"location": "Paris, France", "unit": "celsius"}')
TOKYO_CALL = ParsedCall("get_time", '{"timezone": "Asia/Tokyo"}')

CASES = {
    "single": (f"<tool_call>\n{PARIS}\n</tool_call>", ParsedOutput("", (PARIS_CALL,))),
    "multiple": (f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{TOKYO}\n</tool_call>",
                 ParsedOutput("", (PARIS_CALL, TOKYO_CALL))),
    "content first": (f"Let me check both for you.\n<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{TOKYO}\n"
                      "</tool_call>\n",
                      ParsedOutput("Let me check both for you.\n", (PARIS_CALL, TOKYO_CALL))),
    "text after a call": (f"<tool_call>\n{TOKYO}\n</tool_call>\nDone.",
                          ParsedOutput("\nDone.", (TOKYO_CALL,))),
    "non-ASCII arguments": ('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "東京"}}\n</tool_call>',
                            ParsedOutput("", (ParsedCall("get_time", '{"timezone": "東京"}'),))),
    "no call": ("The weather in Paris is mild today.", ParsedOutput("The weather in Paris is mild today.")),
    "a lone angle bracket": ("x < y and <tool is not a tag", ParsedOutput("x < y and <tool is not a tag")),
    "malformed JSON": ('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}\n</tool_call>',
                       ParsedOutput('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}\n'
                                    '</tool_call>')),
    "unknown name": ('<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>',
                     ParsedOutput('<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>')),
    "unclosed (cut by max_tokens)": (f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_ti",
                                     ParsedOutput('<tool_call>\n{"name": "get_ti', (PARIS_CALL,))),
    "a bad call between good ones": (f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>oops</tool_call>\n"
                                     f"<tool_call>\n{TOKYO}\n</tool_call>",
                                     ParsedOutput("<tool_call>oops</tool_call>", (PARIS_CALL, TOKYO_CALL))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parse_and_every_chunking_of_the_stream_agree(name: str) -> None:
    text, expected = CASES[name]
    assert_every_chunking_matches(HermesToolParser(TOOLS), text, expected)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text, _ = CASES["multiple"]
    assert_every_chunking_matches(HermesToolParser(TOOLS, max_calls=1), text, ParsedOutput("", (PARIS_CALL,)))


def test_content_streams_until_a_call_starts_and_a_call_comes_whole_when_it_closes() -> None:
    stream = HermesToolParser(TOOLS).stream()
    first = stream.feed("Let me check.\n<tool_")
    assert (first.content, first.calls) == ("Let me check.\n", [])  # "<tool_" may become the tag: held
    middle = stream.feed(f"call>\n{PARIS[:30]}")
    assert (middle.content, middle.calls) == ("", [])
    last = stream.feed(f"{PARIS[30:]}\n</tool_call>")
    assert last.content == "" and len(last.calls) == 1
    call = last.calls[0]
    assert (call.index, call.name, call.arguments) == (0, PARIS_CALL.name, PARIS_CALL.arguments)
    assert call.id.startswith("call_")
    assert stream.finish().content == "" and stream.calls_made == 1
