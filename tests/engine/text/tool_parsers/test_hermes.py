"""engine/text/tool_parsers/hermes.py: how a call streams (its formats and failures are in corpus.py)."""

from __future__ import annotations

from engine.text.tool_parsers import HermesToolParser, ToolCallDelta

TOOLS = ("get_current_weather", "get_time")


def test_content_streams_until_a_block_then_the_call_comes_as_a_header_and_argument_fragments() -> None:
    stream = HermesToolParser(TOOLS).stream()
    first = stream.feed("Let me check.\n<tool_")
    assert (first.content, first.calls) == ("Let me check.\n", [])  # "<tool_" may become the tag: held
    assert stream.feed('call>\n{"name": "get_time", "argu').calls == []  # not known until its arguments begin
    header = stream.feed('ments": {"time').calls
    assert len(header) == 1 and header[0].id.startswith("call_")
    assert (header[0].index, header[0].name, header[0].arguments) == (0, "get_time", '{"time')
    assert stream.feed('zone":"UTC"').calls == [ToolCallDelta(0, arguments='zone": "UTC"')]
    assert stream.feed("}}\n</tool_call>").calls == [ToolCallDelta(0, arguments="}")]
    end = stream.finish()
    assert (end.content, end.calls, stream.calls_made, stream.calls_whole) == ("", [], 1, True)


def test_a_block_that_is_not_a_call_is_held_and_then_content() -> None:
    stream = HermesToolParser(TOOLS).stream()
    assert stream.feed('<tool_call>{"name": "send_email", "arg').content == ""
    assert stream.feed('uments": {}}</tool_call> ok').content == '<tool_call>{"name": "send_email", "arguments": {}}' \
        '</tool_call> ok'
    assert stream.calls_made == 0


def test_a_call_cut_short_is_not_whole() -> None:
    stream = HermesToolParser(TOOLS).stream()
    stream.feed('<tool_call>{"name": "get_time", "arguments": {"timezone": "Eur')
    assert stream.finish().calls == [] and stream.calls_made == 1 and not stream.calls_whole
