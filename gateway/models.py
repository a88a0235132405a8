"""The request bodies the gateway accepts, as pydantic v2 models: OpenAI's shape plus the vLLM extras Sluice honours.

Types, bounds and defaults live here, and ``/openapi.json`` is generated from them (gateway/openapi.py).
What one field cannot say alone — ``best_of`` >= ``n``, the ``max_n`` setting, beam search's restrictions,
one output constraint per request — is checked in code on the validated object (gateway/schemas.py).

Why pydantic v2 over msgspec: its errors are structured (a location tuple per error, so a 400 names the
field without parsing an error message's text), it writes JSON Schema 2020-12 (OpenAPI 3.1's dialect)
from the same models, vLLM's own request models are pydantic, and its cost per request is small next to
the rest of a request's CPU (docs/benchmarks.md, "Request validation"). msgspec was not measured: it is
not installed here.

Validation is strict (no "10" for 10, no true for 1), except that an integral float is an integer, as
JSON has one number type. Unknown fields are ignored (and logged once), as vLLM does; the known fields
Sluice does not honour are refused by name (gateway/request_fields.py).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Strict, Tag, WrapValidator
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_TOOLS = 128  # OpenAI's limit
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Union members are tagged with "@" names, which no field has: gateway/fields.py drops them from a 400's `param`.
TAG_PREFIX = "@"


def _integral(value: object) -> object:
    """16.0 is an integer in JSON's eyes."""
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        return int(value)
    return value


def _report_whole(message: str) -> WrapValidator:
    """Any error inside the field is reported at the field itself, with ``message`` (OpenAI names ``stop``, not
    ``stop[0]``)."""
    def validate(value: object, handler: ValidatorFunctionWrapHandler) -> object:
        try:
            return handler(value)
        except ValueError:  # pydantic's ValidationError is one
            raise PydanticCustomError("invalid_field", message) from None
    return WrapValidator(validate)


def _tagged(tags: dict[type, str], message: str) -> Discriminator:
    """A union whose member is chosen by the JSON type of the value, so an error names that member's path only."""
    def tag(value: object) -> str | None:
        for kind, name in tags.items():
            if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
                return name
        return None
    return Discriminator(tag, custom_error_type="invalid_union", custom_error_message=message)


Int = Annotated[int, BeforeValidator(_integral), Strict()]
Number = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[Int, Field(ge=0, le=UINT32_MAX)]
Logprobs = Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)]
JsonObject = dict[str, Any]
Text = Annotated[str, Field(min_length=1)]
# A JSON schema, as an object or as its JSON text (vLLM's guided_json takes both).
SchemaArg = Annotated[Annotated[JsonObject, Tag("@object")] | Annotated[str, Tag("@text")],
                      _tagged({dict: "@object", str: "@text"}, "must be a JSON schema object or its JSON text")]


def _prompt_tag(value: object) -> str | None:
    if isinstance(value, str):
        return "@text"
    if isinstance(value, list):
        ints = [isinstance(v, int) and not isinstance(v, bool) for v in value]
        return "@tokens" if value and all(ints) else "@batch"
    return None


OnePrompt = Annotated[Annotated[Text, Tag("@text")] | Annotated[list[TokenId], Tag("@tokens"), Field(min_length=1)],
                      _tagged({str: "@text", list: "@tokens"}, "must be a string or an array of token ids")]
PromptArg = Annotated[
    Annotated[Text, Tag("@text")]
    | Annotated[list[TokenId], Tag("@tokens"), Field(min_length=1)]
    | Annotated[list[OnePrompt], Tag("@batch"), Field(min_length=1, max_length=MAX_PROMPTS)],
    Discriminator(_prompt_tag, custom_error_type="invalid_union",
                  custom_error_message="must be a string, an array of strings or of token ids"),
]
StopArg = Annotated[str | list[str], _report_whole("must be a string or an array of strings")]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: with include_usage, every chunk "
                                                                  "carries the usage so far.")
    include_obfuscation: bool | None = Field(None, description="OpenAI's; only false: chunks carry no padding.")


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's ``structured_outputs``: one of its keys. Keys Sluice does not honour are refused."""

    model_config = ConfigDict(extra="forbid")
    json_: SchemaArg | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _drop_nulls(value: object) -> object:
    """A key set to null is unset, as vLLM reads them, even one Sluice does not know."""
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


class SamplingFields(_Model):
    """Fields both generation routes take."""

    model: str | None = None
    n: Int | None = Field(None, ge=1, description="Sequences per prompt; at most the gateway's --max-n.")
    best_of: Int | None = Field(None, ge=1, description="Candidates per prompt (>= n); the beam width with "
                                                        "use_beam_search.")
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, le=UINT32_MAX, description="0 or -1: off.")
    min_p: Number | None = Field(None, ge=0, le=1)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0, le=100)
    logit_bias: Annotated[dict[str, Annotated[Number, Field(ge=-100, le=100)]],
                          _report_whole("must map token ids to numbers in [-100, 100]")] | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, description=(
        "vLLM's: only these token ids may be sampled (each below the vocabulary size)."))
    bad_words: list[str] | None = Field(None, max_length=128, description=(
        "vLLM's: words the output never contains (each tokenized as it is and after a space)."))
    min_tokens: Int | None = Field(None, ge=0, le=UINT32_MAX)
    stop: StopArg | None = Field(None, description="Up to 4 strings of 1 to 256 characters.")
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stream_interval: Int | None = Field(None, ge=1, le=UINT32_MAX)
    prompt_logprobs: Logprobs | None = None
    truncate_prompt_tokens: Int | None = Field(None, ge=1, le=UINT32_MAX, description=(
        "vLLM's: keep only the last this many prompt tokens (at most the model's max_model_len)."))
    cache_salt: str | None = Field(None, min_length=1, description=(
        "vLLM's: salts the prefix cache, so only requests with the same salt reuse each other's cached prompt "
        "blocks (a non-empty string)."))
    add_special_tokens: bool | None = Field(None, description=(
        "vLLM's: add the tokenizer's special tokens (BOS) to a text prompt (default true), or to a chat prompt "
        "on top of its template's (default false); token ids are used as they are."))
    priority: Int | None = Field(None, ge=INT32_MIN, le=INT32_MAX)
    use_beam_search: bool | None = None
    length_penalty: Number | None = Field(None, ge=-10, le=10)
    early_stopping: Annotated[bool | Literal["never"], _report_whole('must be true, false or "never"')] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    echo: bool | None = None
    response_format: ResponseFormat | None = None
    guided_json: SchemaArg | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = Field(
        None, description="Sluice's structured outputs run on llguidance.")
    structured_outputs: Annotated[StructuredOutputs, BeforeValidator(_drop_nulls)] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: PromptArg
    max_tokens: Int | None = Field(None, ge=1, le=UINT32_MAX, description="16 when absent, as OpenAI's.")
    logprobs: Logprobs | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


def _auto_detail(value: object) -> object:
    if value in ("low", "high"):
        raise PydanticCustomError("image_detail", "`{value}` cannot be honoured: the model's processor decides each "
                                  "image's resolution; send `auto` or leave it out", {"value": value})
    return value


class ImageURL(_Model):
    url: Text
    # OpenAI's resolution hint: only `auto` (the model's processor decides the resolution); `low` and `high` are
    # refused by name, where vLLM ignores them.
    detail: Annotated[Literal["auto"], BeforeValidator(_auto_detail)] | None = None


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


_PART_TYPES = ("text", "image_url")


def _known_part(value: object, handler: ValidatorFunctionWrapHandler) -> object:
    if not isinstance(value, dict) or value.get("type") not in _PART_TYPES:
        kind = value.get("type") if isinstance(value, dict) else None
        raise PydanticCustomError("content_part", "content part type {kind} is not supported: text and image_url "
                                                  "are", {"kind": repr(kind)})
    return handler(value)


def _part_tag(value: object) -> str:
    return f"@{value.get('type') if isinstance(value, dict) else getattr(value, 'type', None)}"


ContentPartArg = Annotated[Annotated[TextPart, Tag("@text")] | Annotated[ImageURLPart, Tag("@image_url")],
                           Discriminator(_part_tag), WrapValidator(_known_part)]


class FunctionCall(_Model):
    name: Text
    arguments: str = Field(description="The JSON text of an object.")


class ToolCall(_Model):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Annotated[str, Tag("@text")]
                       | Annotated[list[ContentPartArg], Tag("@parts")],
                       _tagged({str: "@text", list: "@parts"}, "must be a string or an array of content parts")] \
        | None \
        = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Model):
    name: Text
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceArg = Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                          _report_whole('must be "none", "auto", "required" or '
                                        '{"type": "function", "function": {"name": ...}}')]


class _ChatTemplate(_Model):
    """How a conversation is rendered, for chat completions and ``/tokenize``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: JsonObject | None = None


class ChatCompletionRequest(SamplingFields, _ChatTemplate):
    """``POST /v1/chat/completions``."""

    max_completion_tokens: Int | None = Field(None, ge=1, le=UINT32_MAX)
    max_tokens: Int | None = Field(None, ge=1, le=UINT32_MAX, description="max_completion_tokens wins.")
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tool_choice: ToolChoiceArg | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = Field(None, description="vLLM's: false leaves reasoning_content out.")
    reasoning_effort: Text | None = Field(None, description=(
        "Passed to the chat template as its `reasoning_effort` variable, as vLLM does (an explicit "
        "chat_template_kwargs entry wins); templates that read none ignore it."))
    thinking_token_budget: Int | None = Field(None, ge=0, le=UINT32_MAX, description=(
        "vLLM's: the most tokens a reasoning model may think for before its thinking is closed (needs the "
        "server's --reasoning-parser)."))


class TokenizeRequest(_Model):
    """vLLM's ``POST /tokenize``: ``prompt``, or a conversation rendered as chat completions render it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: JsonObject | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Model):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


class LoadLoraAdapterRequest(_Model):
    """vLLM's ``POST /v1/load_lora_adapter``; a field it does not know is refused rather than ignored."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(_Model):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
