"""The chat renderer's bounds: an LRU compile cache and an output bound checked as the template writes."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from engine.text import Tokenizer
from engine.text.chat import COMPILE_CACHE_SIZE, ChatTemplateRenderer

HI = [{"role": "user", "content": "hi"}]


def render(renderer: ChatTemplateRenderer, template: str, max_output_chars: int | None = None) -> str:
    return renderer.render(template, HI, add_generation_prompt=False, special_tokens={},
                           max_output_chars=max_output_chars)


def test_the_compile_cache_keeps_the_most_recently_used_templates() -> None:
    renderer = ChatTemplateRenderer(cache_size=2)
    for template in ("a", "b", "a", "c"):
        render(renderer, template)
    assert renderer.cached == ["a", "c"]  # "b", least recently used, went first


def test_the_default_cache_holds_64_templates() -> None:
    renderer = ChatTemplateRenderer()
    templates = [f"t{i}" for i in range(COMPILE_CACHE_SIZE + 1)]
    for template in templates:
        render(renderer, template)
    assert COMPILE_CACHE_SIZE == 64 and renderer.cached == templates[1:]


def test_the_output_bound_allows_exactly_its_size_and_stops_one_more() -> None:
    renderer = ChatTemplateRenderer()
    template = "{% for i in range(5) %}ab{% endfor %}"
    assert render(renderer, template, max_output_chars=10) == "ababababab"
    with pytest.raises(InvalidRequestError) as info:
        render(renderer, template, max_output_chars=9)
    assert (info.value.field, info.value.message) == ("chat_template", "the chat template's output passes 9 characters")


def test_the_longest_token_and_encode_as_the_backend_encodes(smollm: Tokenizer) -> None:
    longest = max(len(smollm.token_to_bytes(i)) for i in range(smollm.vocab_size))
    assert smollm.max_token_bytes == longest == 81
    text = "Fun 🎉 times\n" + " " * 80 + "end"
    assert smollm.encode(text) == smollm.backend.encode(text).ids
