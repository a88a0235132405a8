"""Drives a parser's stream over ways of cutting a text into pieces and reassembles what came out."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator

from engine.text.tool_parsers import ParsedCall, ParsedOutput, StreamDelta, ToolParser

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def chunkings(text: str) -> Iterator[list[str]]:
    """The text whole, one character at a time, and cut at every one and every two places."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, len(text)), 2):
        yield [text[:i], text[i:j], text[j:]]


def cuts(text: str, seed: int, random_chunkings: int = 24) -> Iterator[list[str]]:
    """The text whole, one character at a time, cut once at every place, and cut at random into pieces of 1 to
    12 characters (some empty, as a delta with no new text)."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(random_chunkings):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(0, 12)
            pieces.append(text[i:i + n])
            i += n
        yield pieces


def reassemble(deltas: list[StreamDelta]) -> ParsedOutput:
    """Content concatenated; calls from their deltas: the first has a fresh call_ id and the name, every
    later one only argument fragments; indexes count up from 0."""
    content = "".join(d.content for d in deltas)
    calls: list[list[str]] = []
    ids: list[str] = []
    for d in deltas:
        for c in d.calls:
            if c.index == len(calls):
                assert CALL_ID.fullmatch(c.id) and c.name, c
                assert c.id not in ids
                ids.append(c.id)
                calls.append([c.name, c.arguments])
            else:
                assert c.index == len(calls) - 1 and not c.id and not c.name, c
                calls[-1][1] += c.arguments
    return ParsedOutput(content, tuple(ParsedCall(name, args) for name, args in calls))


def streamed(parser: ToolParser, pieces: list[str]) -> ParsedOutput:
    stream = parser.stream()
    deltas = [stream.feed(p) for p in pieces]
    deltas.append(stream.finish())
    result = reassemble(deltas)
    assert stream.calls_made == len(result.calls)
    return result


def assert_every_chunking_matches(parser: ToolParser, text: str, expected: ParsedOutput) -> None:
    assert parser.parse(text) == expected
    for pieces in chunkings(text):
        assert streamed(parser, pieces) == expected, pieces
