"""engine/text/tool_parsers/json_reader.py: JSON read as it arrives, checked and laid out one way."""

from __future__ import annotations

import json

import pytest

from engine.text.tool_parsers.json_reader import CallObjectReader, JsonReader


def read(text: str, first: str | None = None) -> tuple[JsonReader, int, str]:
    reader = JsonReader(first)
    pos, out = reader.feed(text)
    return reader, pos, out


@pytest.mark.parametrize(("text", "laid_out"), [
    ('{"a":1,"b" :[ true ,false, null,-0.5e+3 ],"c":{}}', '{"a": 1, "b": [true, false, null, -0.5e+3], "c": {}}'),
    ('  {\n  "s": "x\\"y\\\\z\\u00e9\\n", "e": []\n}', '{"s": "x\\"y\\\\z\\u00e9\\n", "e": []}'),
    ('{"日本": "語 🎌"}', '{"日本": "語 🎌"}'),
    ('"just a string"', '"just a string"'),
    ("[1, [2, [3]]]", "[1, [2, [3]]]"),
])
def test_a_valid_value_is_read_whole_and_laid_out_as_json_dumps_does(text: str, laid_out: str) -> None:
    reader, pos, out = read(text + " tail")
    assert reader.done and not reader.failed and out == laid_out
    assert text[pos:].strip() == "" and json.loads(out) == json.loads(text)
    pieces = JsonReader()
    assert "".join(pieces.feed(c)[1] for c in text) == laid_out and pieces.done  # one character at a time


@pytest.mark.parametrize(("text", "stops_at"), [
    ('{"a": tru }', 9), ('{"a": 01}', 8), ('{"a" 1}', 5), ('{"a": 1,}', 8), ("{'a': 1}", 1), ('{"a": "x\ny"}', 8),
    ('{"a": "\\q"}', 8), ('{"a": "\\u12g4"}', 11), ('{"a": [1}', 8), ('{"a": 1.}', 8), ("nul!", 3),
])
def test_an_invalid_value_fails_where_it_cannot_go_on(text: str, stops_at: int) -> None:
    reader, pos, out = read(text)  # a number or literal is checked where it ends
    assert reader.failed and not reader.done and pos == stops_at
    assert text[:pos].replace(" ", "").startswith(out.replace(" ", ""))  # what was written is what was read


def test_first_requires_an_object() -> None:
    assert read('"x"', first="{")[0].failed
    assert read('  {"x": 1}', first="{")[0].done


def test_a_call_object_gives_its_name_and_its_arguments_text() -> None:
    reader = CallObjectReader(("arguments",), lambda name: name == "f")
    text = '{"id": [1, {"name": "g"}], "arguments": {"name": "x"}, "name": "f", "extra": null} rest'
    pos = reader.feed(text)
    assert reader.done and text[pos:] == " rest" and reader.name == "f"
    assert reader.take_arguments() == '{"name": "x"}' and reader.take_arguments() == ""


@pytest.mark.parametrize("text", ['{"name": "g", "arguments": {}}', '{"arguments": {}}', '{"name": 1}',
                                  '{"name": "f", "arguments": [1]}', '["name", "f"]'])
def test_a_call_object_fails_when_it_is_not_a_call_of_a_known_tool(text: str) -> None:
    reader = CallObjectReader(("arguments",), lambda name: name == "f")
    reader.feed(text)
    assert reader.failed and not reader.done


def test_a_call_object_without_arguments_has_empty_ones() -> None:
    reader = CallObjectReader(("parameters", "arguments"), lambda name: True)
    reader.feed('{"name": "f"}')
    assert reader.done and reader.take_arguments() == "{}"
