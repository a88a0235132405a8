"""engine/text/reasoning: the corpus split at every byte boundary (and cut in two places, and fed a byte at a
time) reads the same as the whole, for each parser and either starting state; exact splits of the outputs those
models write; when the output starts inside the thinking block."""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Iterator

import pytest

from engine.text.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningOutput,
    ReasoningParser,
    prompt_ends_thinking,
)

# Outputs as the models write them, and the text around tags that must not be taken for one.
CORPUS = {
    # R1-0528 / Qwen3-Thinking-2507: the template opened the block, the model writes only the end tag
    "template_opened": "Okay, the user asks for 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
    # R1 / Qwen3 (up to 2507): the model writes both tags
    "both_tags": "<think>\nLet me check: 17 is prime.\n</think>\n\nYes, 17 is prime.",
    "empty_block": "<think>\n\n</think>\n\nHello!",
    "cut_short": "<think>\nHmm, a long thought that max_tokens ends",
    "end_tag_only": "</think>the answer at once",
    "no_tags": "Just an answer with no thinking at all.",
    "non_ascii": "<think>考虑一下 🎉 ça va…</think>答案是 4 ✅ — fin",
    "lookalikes": "<thin <think > </thinking> a < b, x </th k <thinker>\n</think>done </thi",
    "second_start_stays": "<think>a <think> b</think>c",
    "tags_after_answer_are_content": "plan</think>answer <think>not thinking</think> end",
    "tool_call_after": ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n'
                        '{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'),
    "ends_on_partial_end_tag": "thinking until </thi",
    "ends_on_partial_start_tag": "<thi",
    "tag_split_by_start": "</<think>think> still thinking",
    "empty": "",
}
PARSERS = [cls() for cls in REASONING_PARSERS.values()]


def pieces(text: str) -> Iterator[list[str]]:
    """The text whole; cut at every byte boundary; fed one byte at a time; cut at every two character places.
    Bytes go through an incremental UTF-8 decoder, as the detokenizer never emits half a character."""
    data = text.encode()
    yield [text]
    for cuts in [[k] for k in range(1, len(data))] + [list(range(1, len(data)))]:
        decoder = codecs.getincrementaldecoder("utf-8")()
        bounds = [0, *cuts, len(data)]
        yield [decoder.decode(data[a:b], final=b == len(data)) for a, b in zip(bounds, bounds[1:])]
    if len(text) <= 80:
        for i, j in itertools.combinations(range(1, len(text)), 2):
            yield [text[:i], text[i:j], text[j:]]


def streamed(parser: ReasoningParser, parts: list[str], thinking: bool) -> ReasoningOutput:
    stream = parser.stream(thinking)
    outs = [stream.feed(p) for p in parts] + [stream.finish()]
    return ReasoningOutput("".join(o.reasoning for o in outs), "".join(o.content for o in outs))


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "answer"])
@pytest.mark.parametrize("name", list(CORPUS))
def test_every_split_reads_as_the_whole(parser: ReasoningParser, thinking: bool, name: str) -> None:
    text = CORPUS[name]
    whole = parser.parse(text, thinking)
    for parts in pieces(text):
        assert streamed(parser, parts, thinking) == whole, parts


@pytest.mark.parametrize(("name", "reasoning", "content"), [
    ("template_opened", "Okay, the user asks for 2+2.\nThat is 4.\n", "\n\nThe answer is **4**."),
    ("both_tags", "\nLet me check: 17 is prime.\n", "\n\nYes, 17 is prime."),
    ("empty_block", "\n\n", "\n\nHello!"),
    ("cut_short", "\nHmm, a long thought that max_tokens ends", ""),
    ("end_tag_only", "", "the answer at once"),
    ("no_tags", "Just an answer with no thinking at all.", ""),
    ("non_ascii", "考虑一下 🎉 ça va…", "答案是 4 ✅ — fin"),
    ("lookalikes", "<thin <think > </thinking> a < b, x </th k <thinker>\n", "done </thi"),
    ("second_start_stays", "a <think> b", "c"),
    ("tags_after_answer_are_content", "plan", "answer <think>not thinking</think> end"),
    ("ends_on_partial_end_tag", "thinking until </thi", ""),
    ("ends_on_partial_start_tag", "<thi", ""),
    ("tag_split_by_start", "</think> still thinking", ""),
])
def test_exact_split_of_an_output_that_starts_thinking(name: str, reasoning: str, content: str) -> None:
    for parser in PARSERS:
        assert parser.parse(CORPUS[name], thinking=True) == ReasoningOutput(reasoning, content)


def test_an_output_that_starts_as_the_answer_is_all_answer() -> None:
    for parser in PARSERS:
        assert parser.parse(CORPUS["both_tags"], thinking=False) == ReasoningOutput("", CORPUS["both_tags"])


def test_a_tag_in_pieces_is_held_back_then_split() -> None:
    stream = DeepSeekR1ReasoningParser().stream(thinking=True)
    assert stream.feed("<th") == ReasoningOutput()
    assert stream.feed("ink>abc</th") == ReasoningOutput("abc")
    assert stream.thinking
    assert stream.feed("ink>\n\nanswer") == ReasoningOutput("", "\n\nanswer")
    assert not stream.thinking
    assert stream.feed("</think>") == ReasoningOutput("", "</think>")
    assert stream.finish() == ReasoningOutput()


def test_held_back_text_that_was_no_tag_is_thinking_at_the_end() -> None:
    stream = Qwen3ReasoningParser().stream(thinking=True)
    assert stream.feed("a </thi") == ReasoningOutput("a ")
    assert stream.finish() == ReasoningOutput("</thi")


def test_when_the_output_starts_thinking() -> None:
    r1, qwen3 = DeepSeekR1ReasoningParser(), Qwen3ReasoningParser()
    for parser in (r1, qwen3):
        assert parser.thinking_at_start(False, {})
        assert not parser.thinking_at_start(True, {})  # the template closed the block
    # Qwen3's switch, whatever the template did with it; R1 has none.
    assert not qwen3.thinking_at_start(False, {"enable_thinking": False})
    assert qwen3.thinking_at_start(False, {"enable_thinking": True})
    assert r1.thinking_at_start(False, {"enable_thinking": False})


def test_the_prompt_ends_thinking_when_its_last_tag_is_the_end_tag() -> None:
    start, end = 7, 8
    assert not prompt_ends_thinking([1, 2, 3], start, end)                # no tags: the model thinks
    assert not prompt_ends_thinking([1, 2, start], start, end)            # the template opened the block
    assert prompt_ends_thinking([1, start, 9, end, 4], start, end)        # enable_thinking=false's empty block
    assert not prompt_ends_thinking([start, end, 5, start, 6], start, end)  # an earlier turn's block, a new one
    assert prompt_ends_thinking([end], start, end)
