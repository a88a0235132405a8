"""engine/text/chat.py: chat templates rendered as transformers renders them, bad messages rejected."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from engine.text import Tokenizer

SYSTEM_USER_ASSISTANT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? 🇮🇹"},
]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    SYSTEM_USER_ASSISTANT,
    [{"role": "user", "content": "a\n\n  {{ not jinja }} <|im_end|>"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(smollm: Tokenizer, reference, messages, add_generation_prompt: bool) -> None:  # type: ignore[no-untyped-def]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_default_model_prompt_exactly(smollm: Tokenizer) -> None:
    assert smollm.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_text_parts_are_joined(smollm: Tokenizer, reference) -> None:  # type: ignore[no-untyped-def]
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    expected = reference.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert smollm.apply_chat_template(parts) == expected
    assert "<|im_start|>user\nfirst\nsecond<|im_end|>\n" in expected


def test_request_template_bos_eos_and_kwargs(smollm: Tokenizer) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}{{ x }}"
    out = smollm.apply_chat_template([{"role": "user", "content": "q"}], chat_template=template, x="!")
    assert out == "<|im_start|>[user]q<|im_end|>!"


def test_template_helpers_like_transformers(smollm: Tokenizer) -> None:
    template = ("{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m | tojson }}"
                "{% generation %}<gen>{% endgeneration %}{% endfor %}")
    out = smollm.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": "é<"}],
                                     chat_template=template)
    assert out == '{"role": "assistant", "content": "é<"}<gen>'  # no HTML escaping, no \u escapes


def test_trim_and_lstrip_blocks(smollm: Tokenizer) -> None:
    template = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert smollm.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template) == "x\n"


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": "wizard", "content": "x"}], "unknown role 'wizard'"),
    ([{"role": "user"}], "no content"),
    ([{"content": "x"}], "unknown role None"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "not a text part"),
    ([{"role": "user", "content": 42}], "string or a list"),
    (["just a string"], "not an object"),
    ([], "must not be empty"),
    ("hello", "must be a list"),
])
def test_bad_messages_name_messages(smollm: Tokenizer, messages, fragment: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError) as info:
        smollm.apply_chat_template(messages)
    assert info.value.field == "messages"
    assert fragment in info.value.message


def test_template_that_raises_names_messages(smollm: Tokenizer) -> None:
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}"
    with pytest.raises(InvalidRequestError) as info:
        smollm.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)
    assert info.value.field == "messages" and "first message must be system" in info.value.message
    # A template failing on data (a missing key concatenated) is the messages' fault too.
    with pytest.raises(InvalidRequestError) as info:
        smollm.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ messages[0].name + 'x' }}")
    assert info.value.field == "messages"


def test_assistant_tool_call_without_content_is_allowed(smollm: Tokenizer) -> None:
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    out = smollm.apply_chat_template(messages, chat_template="{{ messages[0].tool_calls[0].id }}")
    assert out == "1"


def test_sandbox_blocks_attribute_escapes(smollm: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError) as info:
        smollm.apply_chat_template([{"role": "user", "content": "x"}],
                                   chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    assert info.value.field == "messages"


def test_no_template_and_bad_syntax_are_clear(smollm: Tokenizer) -> None:
    bare = Tokenizer(smollm.backend)
    with pytest.raises(InvalidRequestError) as info:
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    assert info.value.field == "chat_template" and "no chat template" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        smollm.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
    assert info.value.field == "chat_template"


def test_gguf_chat_template_uses_file_bos_eos(tiny_spm_gguf: str) -> None:
    tok = Tokenizer.from_pretrained(tiny_spm_gguf)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>user: hi</s>"
