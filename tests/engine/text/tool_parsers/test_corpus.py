"""Every parser of engine/text/tool_parsers/ on the corpus of its family's call formats: the whole output
parses to the documented calls and content, and the stream, fed the output cut in any way, says the same."""

from __future__ import annotations

import itertools
import json
import random
import zlib

import pytest

from engine.text.tool_parsers import TOOL_PARSERS, ParsedOutput, ToolParser
from tests.engine.text.tool_parsers.corpus import CASES, FAMILIES, LONG, LONG_TEXT, PARAMETERS, TOOLS, Case, Cut
from tests.engine.text.tool_parsers.streaming import cuts, streamed


def parser_for(family: str, max_calls: int | None = None) -> ToolParser:
    return TOOL_PARSERS[family](TOOLS, max_calls, parameters=PARAMETERS)


def assert_documented(case: Case, parsed: ParsedOutput) -> None:
    assert parsed.content == case.content
    assert [call.name for call in parsed.calls] == [name for name, _ in case.calls]
    for call, (_, expected) in zip(parsed.calls, case.calls):
        if isinstance(expected, Cut):
            assert call.arguments == expected.text
        else:
            assert json.loads(call.arguments) == expected, call.arguments


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_whole_output_parses_to_the_documented_calls(case: Case) -> None:
    assert_documented(case, parser_for(case.family, case.max_calls).parse(case.text))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_stream_cut_anywhere_says_the_same(case: Case) -> None:
    parser = parser_for(case.family, case.max_calls)
    whole = parser.parse(case.text)
    for pieces in cuts(case.text, seed=zlib.crc32(case.id.encode())):
        assert streamed(parser, pieces) == whole, pieces


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_calls_are_whole_unless_their_arguments_broke_off(case: Case) -> None:
    stream = parser_for(case.family, case.max_calls).stream()
    stream.feed(case.text)
    stream.finish()
    assert stream.calls_whole == case.calls_whole


@pytest.mark.parametrize("family", FAMILIES)
def test_long_arguments_arrive_in_fragments_as_they_are_written(family: str) -> None:
    stream = parser_for(family).stream()
    text = LONG[family]
    deltas = [stream.feed(text[i:i + 8]) for i in range(0, len(text), 8)] + [stream.finish()]
    pieces = [call for delta in deltas for call in delta.calls]
    assert pieces[0].name == "send_message" and pieces[0].id.startswith("call_")
    assert all(piece.index == 0 and not piece.id and not piece.name for piece in pieces[1:])
    assert len(pieces) > len(LONG_TEXT) // 8 - 2  # about one fragment per piece fed: none held to the end
    assert json.loads("".join(piece.arguments for piece in pieces)) == {"text": LONG_TEXT}
    assert "".join(delta.content for delta in deltas) == ""


def test_every_family_has_a_documented_corpus() -> None:
    assert {case.family for case in CASES} | {"deepseek_v31"} == set(TOOL_PARSERS) == set(FAMILIES) | {"deepseek_v31"}
    assert TOOL_PARSERS["deepseek_v31"] is TOOL_PARSERS["deepseek_v3"]


MARKERS = ['"', "'", "{", "}", "[", "]", "(", ")", ",", ":", ";", "=", "\\", "\n", " ", "x", "1", "null", "é",
           '"name"', '"arguments"', "get_time", "<", ">", "```json", "<tool_call>", "</tool_call>", "<function=",
           "</function>", "<parameter=", "</parameter>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
           "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "\\ud83d"]


@pytest.mark.parametrize("family", FAMILIES)
def test_damaged_outputs_stream_as_they_parse_and_whole_calls_are_json(family: str) -> None:
    """The corpus's texts with pieces deleted, markers inserted, or cut off: whatever they parse to, the stream
    cut at random says the same, and calls reported whole have arguments that are JSON objects."""
    rng = random.Random(family)
    texts = [case.text for case in CASES if case.family == family]
    for _ in range(150):
        text = list(rng.choice(texts))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text) + 1)
            kind = rng.random()
            if kind < 0.4 and at < len(text):
                del text[at]
            elif kind < 0.85:
                text.insert(at, rng.choice(MARKERS))
            else:
                del text[at:]
        damaged = "".join(text)
        parser = parser_for(family, rng.choice((None, 1)))
        whole = parser.parse(damaged)
        for pieces in itertools.islice(cuts(damaged, seed=rng.randrange(2**32)), 1, None, max(1, len(damaged) // 4)):
            assert streamed(parser, pieces) == whole, pieces
        stream = parser.stream()
        stream.feed(damaged)
        stream.finish()
        if stream.calls_whole:
            assert all(isinstance(json.loads(call.arguments), dict) for call in whole.calls), damaged
