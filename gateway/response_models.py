"""The response bodies the gateway returns, as pydantic models: they document ``/openapi.json``.

The bodies themselves are built as plain dicts (gateway/responses.py, routes/*.py: building a model per
chunk would cost a stream CPU for nothing); tests/gateway/test_openapi_fuzz.py checks that every body
served conforms to these schemas. Fields a client may meet beyond OpenAI's are vLLM's (``stop_reason``,
``prompt_logprobs``, ``max_model_len``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    """Every error: OpenAI's body."""

    error: ErrorDetail


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# Logprobs are OpenAI's shapes (legacy per-token lists for completions, content lists for chat), and vLLM's
# prompt_logprobs a list with one map (token id -> logprob entry) per prompt token, null for the first.
Logprobs = dict[str, Any] | None
PromptLogprobs = list[dict[str, Any] | None]
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"] | None


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: Logprobs
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(_Body):
    """``/v1/completions`` without ``stream``; with it, chunks of this shape whose choices carry one delta."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # a reasoning model's thinking (the server's --reasoning-parser)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: Logprobs
    finish_reason: FinishReason
    stop_reason: str | int | None = None


class ChatCompletion(_Body):
    """``/v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None
    usage: Usage


class FunctionCallDelta(_Body):
    name: str | None = None
    arguments: str


class ToolCallDelta(_Body):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Body):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: Logprobs
    finish_reason: FinishReason
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Body):
    """One ``data:`` event of a chat stream; the last before ``[DONE]`` carries ``usage`` alone when
    ``stream_options.include_usage`` is set (with ``continuous_usage_stats``, every chunk its usage so far)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(_Body):
    """``GET /v1/models``: the served model(s), then each LoRA adapter with its base model as ``parent``."""

    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Body):
    prompt: str
