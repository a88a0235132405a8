"""engine/text/chat.py: chat templates rendered as transformers renders them, bad messages rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import InvalidRequestError
from engine.text import Tokenizer
from engine.text.chat import load_chat_template

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


# Qwen2.5-Instruct's template (Hermes-style tool calls), as its tokenizer_config.json ships it.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_current_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["location"]}}}


def tool_turns(arguments: object) -> list[dict[str, object]]:
    """A user question, the assistant's call (``arguments`` as given), the tool's result, as OpenAI sends them."""
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_current_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "unit": "celsius"}'}]


def qwen_reference(smollm: Tokenizer):  # type: ignore[no-untyped-def]
    """transformers' renderer on the same vocabulary with Qwen2.5's template."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=smollm.backend)
    reference.chat_template = QWEN25_TEMPLATE
    return reference


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_tool_calls_and_tool_results_render_as_transformers(smollm: Tokenizer,
                                                                  add_generation_prompt: bool) -> None:
    # The request carries arguments as JSON text; templates get them parsed (as vLLM passes them).
    arguments = {"location": "Paris, France", "unit": "celsius"}
    expected = qwen_reference(smollm).apply_chat_template(
        tool_turns(arguments), tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=add_generation_prompt)
    got = smollm.apply_chat_template(tool_turns(json.dumps(arguments)), chat_template=QWEN25_TEMPLATE,
                                     tools=[WEATHER_TOOL], add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris, France", ' in got
    assert '"name": "get_current_weather", "description": "Current weather in a city"' in got
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21' in got


@pytest.mark.parametrize("arguments, fragment", [
    ('{"location": "Paris"', "is not valid JSON"),
    ('["Paris"]', "must be a JSON object"),
])
def test_bad_tool_call_arguments_name_the_message(smollm: Tokenizer, arguments: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        smollm.apply_chat_template(tool_turns(arguments), chat_template=QWEN25_TEMPLATE)
    assert info.value.field == "messages"
    assert info.value.message.startswith("messages[1].tool_calls[0].function.arguments ")
    assert fragment in info.value.message


def test_load_chat_template_reads_a_file_or_takes_the_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}", encoding="utf-8")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
