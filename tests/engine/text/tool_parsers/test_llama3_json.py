"""engine/text/tool_parsers/llama3_json.py: how an output streams (its formats and failures are in corpus.py)."""

from __future__ import annotations

from engine.text.tool_parsers import Llama3JsonToolParser, ToolCallDelta

TOOLS = ("get_current_weather", "get_time")


def test_a_plain_answer_streams_as_it_comes() -> None:
    stream = Llama3JsonToolParser(TOOLS).stream()
    assert stream.feed(" ").content == ""  # whitespace alone does not say which
    assert stream.feed("It").content == " It"
    assert stream.feed(" is").content == " is"
    assert stream.finish().content == "" and stream.calls_made == 0


def test_an_output_that_starts_like_a_call_is_held_until_the_call_is_known() -> None:
    stream = Llama3JsonToolParser(TOOLS).stream()
    assert stream.feed('<|python_tag|>{"name": "get_time", ').calls == []
    header = stream.feed('"parameters": {"timezone": "U').calls
    assert [(c.index, c.name, c.arguments) for c in header] == [(0, "get_time", '{"timezone": "U')]
    assert stream.feed('TC"}};').calls == [ToolCallDelta(0, arguments='TC"}')]
    assert stream.feed(' {"name": "get_ti').content == ""  # after ";": held until it is a call or not
    assert stream.finish().content == '; {"name": "get_ti'
