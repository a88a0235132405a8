"""OpenAI (and vLLM-extension) request bodies, from their validated models to the gateway's types.

The models (gateway/models.py) check each field's type and bounds; what spans
fields or settings is checked here, on the typed object, before any backend
call, and reported as a 400 naming the field. Unknown fields are ignored, as
vLLM does (and logged once per name); known fields Sluice does not honour are
refused by name, never dropped (gateway/request_fields.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gateway.backend import BeamSearch, BeamStopping, ChatTurn, GenerationParams, Prompt, ToolChoiceMode
from gateway.errors import bad_request
from gateway.fields import validate
from gateway.guided import to_guided
from gateway.models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from gateway.multimodal import content_parts
from gateway.request_fields import CHAT_REFUSED, COMPLETION_REFUSED, declared, log_unknown, refuse
from gateway.tools import to_tool_calls, to_tool_choice, to_tools

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_LENGTH = 256  # characters; the detokenizer holds back this much text
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
_COMPLETION_FIELDS = declared(CompletionRequest) | COMPLETION_REFUSED.keys()
_CHAT_FIELDS = declared(ChatCompletionRequest) | CHAT_REFUSED.keys()
# Sampling fields beam search does not use, with the values that mean "off": any other is refused with it.
_NOT_FOR_BEAMS: dict[str, tuple[object, ...]] = {"temperature": (0,), "top_p": (1,), "top_k": (0, -1), "min_p": (0,),
                                                 "seed": ()}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` request."""

    is_chat: bool
    model: str | None
    prompts: tuple[Prompt, ...]  # one per prompt of a batched completion; chat has one
    params: GenerationParams
    stream: bool
    include_usage: bool
    echo_prefix: str = ""  # chat echo: the gateway starts each choice's content with it
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far
    include_reasoning: bool = True  # chat: False leaves a reasoning model's thinking out of the response


@dataclass(frozen=True)
class Tokenize:
    model: str | None
    prompt: Prompt
    add_special_tokens: bool | None
    return_token_strs: bool


@dataclass(frozen=True)
class Detokenize:
    model: str | None
    token_ids: tuple[int, ...]


def parse_completion(body: Mapping[str, object], max_n: int) -> GenerationRequest:
    refuse(body, COMPLETION_REFUSED)
    log_unknown(body, _COMPLETION_FIELDS)
    req = validate(CompletionRequest, body)
    prompts = _prompts(req.prompt)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = _params(req, max_n, max_tokens, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                     echo=bool(req.echo))
    stream, include_usage, continuous = _stream(req, params)
    return GenerationRequest(False, req.model, prompts, params, stream, include_usage, continuous_usage=continuous)


def parse_chat(body: Mapping[str, object], max_n: int) -> GenerationRequest:
    refuse(body, CHAT_REFUSED)
    log_unknown(body, _CHAT_FIELDS)
    req = validate(ChatCompletionRequest, body)
    turns = _messages(req.messages)
    logprobs = bool(req.logprobs)
    if req.top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs", "`top_logprobs` needs `logprobs` set to true.")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tools = to_tools(req.tools)
    tool_choice = to_tool_choice(req.tool_choice, tools)
    params = _params(req, max_n, max_tokens, logprobs=logprobs, top_logprobs=req.top_logprobs or 0, echo=False)
    if params.guided is not None and tool_choice is not None and tool_choice.mode in (ToolChoiceMode.REQUIRED,
                                                                                      ToolChoiceMode.FUNCTION):
        raise bad_request("tool_choice", "`tool_choice` that forces a call constrains the output itself: it "
                                         "cannot be combined with `response_format` or guided decoding.")
    params = replace(params, tool_choice=tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                     thinking_token_budget=req.thinking_token_budget)
    prompt = _chat_prompt(req, turns)
    stream, include_usage, continuous = _stream(req, params)
    # vLLM's chat echo: a conversation ending in an assistant turn is continued, and the answer repeats it.
    echo = bool(req.echo) and turns[-1].role == "assistant"
    return GenerationRequest(True, req.model, (prompt,), params, stream, include_usage,
                             turns[-1].content if echo else "", continuous_usage=continuous,
                             include_reasoning=req.include_reasoning is not False)


def parse_tokenize(body: Mapping[str, object]) -> Tokenize:
    """vLLM's ``/tokenize``: ``prompt`` (a string) or chat ``messages`` (with ``tools``, ``chat_template`` and
    ``chat_template_kwargs``, rendered as a chat completion would render them)."""
    req = validate(TokenizeRequest, body)
    if req.messages is not None:
        prompt = _chat_prompt(req, _messages(req.messages))
    elif req.prompt is not None:
        prompt = Prompt(text=req.prompt)
    else:
        raise bad_request("prompt", "`prompt` is required (or chat `messages`).")
    return Tokenize(req.model, prompt, req.add_special_tokens, bool(req.return_token_strs))


def parse_detokenize(body: Mapping[str, object]) -> Detokenize:
    req = validate(DetokenizeRequest, body)
    return Detokenize(req.model, tuple(req.tokens))


def _chat_prompt(req: ChatCompletionRequest | TokenizeRequest, turns: tuple[ChatTurn, ...]) -> Prompt:
    kwargs = req.chat_template_kwargs
    effort = req.reasoning_effort if isinstance(req, ChatCompletionRequest) else None
    if effort is not None:  # vLLM hands it to the template; the request's own kwargs win
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    return Prompt(chat=turns, add_generation_prompt=req.add_generation_prompt is not False, tools=to_tools(req.tools),
                  chat_template=req.chat_template,
                  chat_template_kwargs="" if kwargs is None else json.dumps(kwargs, ensure_ascii=False))


def _stream(req: SamplingFields, params: GenerationParams) -> tuple[bool, bool, bool]:
    """``stream``, ``include_usage`` and vLLM's ``continuous_usage_stats`` (usage on every chunk; it needs
    ``include_usage``, as in vLLM)."""
    stream = bool(req.stream)
    if stream and params.prompt_logprobs is not None:  # as vLLM: they would come before the first token
        raise bad_request("prompt_logprobs", "`prompt_logprobs` are not available when `stream` is true.")
    options = req.stream_options
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options", "`stream_options` is only allowed when `stream` is true.")
    if options.include_obfuscation:
        raise bad_request("stream_options.include_obfuscation",
                          "`stream_options.include_obfuscation` can only be false: chunks carry no padding.")
    include_usage = bool(options.include_usage)
    return stream, include_usage, include_usage and bool(options.continuous_usage_stats)


def _prompts(value: str | list[int] | list[str | list[int]]) -> tuple[Prompt, ...]:
    """A string, a list of token ids, or a list of strings and lists of token ids (the model's shapes)."""
    if isinstance(value, str):
        return (Prompt(text=value),)
    if all(isinstance(v, int) for v in value):
        return (Prompt(token_ids=tuple(v for v in value if isinstance(v, int))),)
    return tuple(Prompt(text=v) if isinstance(v, str) else Prompt(token_ids=tuple(v)) for v in value
                 if not isinstance(v, int))


def _messages(messages: list[ChatMessage]) -> tuple[ChatTurn, ...]:
    return tuple(_turn(m, f"messages[{i}]") for i, m in enumerate(messages))


def _turn(msg: ChatMessage, name: str) -> ChatTurn:
    if msg.content is None and msg.role != "assistant":  # only an assistant turn may just call tools
        raise bad_request(f"{name}.content", f"`{name}.content` is required for a {msg.role} message.")
    content = msg.content or ""
    text, parts = content_parts(content)
    if msg.tool_calls and msg.role != "assistant":
        raise bad_request(f"{name}.tool_calls", f"`{name}.tool_calls` is only for assistant messages.")
    if msg.role == "tool" and not msg.tool_call_id:
        raise bad_request(f"{name}.tool_call_id", f"`{name}.tool_call_id` is required for a tool message.")
    if msg.role != "tool" and msg.tool_call_id is not None:
        raise bad_request(f"{name}.tool_call_id", f"`{name}.tool_call_id` is only for tool messages.")
    # "developer" is OpenAI's newer name for the system role; templates know "system".
    return ChatTurn("system" if msg.role == "developer" else msg.role, text, msg.name,
                    to_tool_calls(msg.tool_calls, name), msg.tool_call_id, parts)


def _stop(value: str | list[str] | None) -> tuple[str, ...]:
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"`stop` may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    for s in stops:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise bad_request("stop", f"Each `stop` string must be 1 to {MAX_STOP_LENGTH} characters long.")
    return tuple(stops)


def _logit_bias(value: dict[str, float] | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, b in (value or {}).items():
        if not key.isdigit() or int(key) > 2**32 - 1:
            raise bad_request("logit_bias", f"`logit_bias` keys must be token ids, got {key[:32]!r}.")
        bias[int(key)] = b
    return bias


def _params(req: SamplingFields, max_n: int, max_tokens: int | None, *, logprobs: bool, top_logprobs: int,
            echo: bool) -> GenerationParams:
    min_tokens = req.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request("min_tokens", f"`min_tokens` must be <= max_tokens ({max_tokens}), got {min_tokens}.")
    n = req.n or 1
    if n > max_n:
        raise bad_request("n", f"`n` must be in [1, {max_n}], got {n}.")
    best_of, beam_search = _best_of_and_beam(req, n, max_n)
    return GenerationParams(
        n=n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=None if req.top_k in (None, -1, 0) else req.top_k,  # vLLM spells "disabled" 0 or -1
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=tuple(req.allowed_token_ids or ()),
        bad_words=tuple(req.bad_words or ()),
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(req.stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        echo=echo,
        stream_interval=req.stream_interval,
        prompt_logprobs=req.prompt_logprobs,
        guided=to_guided(req),
        priority=req.priority or 0,
        best_of=best_of,
        beam_search=beam_search,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        add_special_tokens=req.add_special_tokens,
        cache_salt=req.cache_salt or "",
    )


def _best_of_and_beam(req: SamplingFields, n: int, max_n: int) -> tuple[int | None, BeamSearch | None]:
    """``best_of`` (more candidates than ``n``), or beam search as vLLM spells it: ``use_beam_search``
    with ``best_of`` (else ``n``) beams, ``length_penalty`` and ``early_stopping``."""
    best_of = req.best_of
    if best_of is not None and best_of > max_n:
        raise bad_request("best_of", f"`best_of` must be in [1, {max_n}], got {best_of}.")
    if best_of is not None and best_of < n:
        raise bad_request("best_of", f"`best_of` must be >= n ({n}), got {best_of}.")
    length_penalty, early = req.length_penalty, req.early_stopping
    if not req.use_beam_search:
        # Their defaults change nothing; any other value needs beams, so it is refused without them.
        if length_penalty not in (None, 1.0):
            raise bad_request("length_penalty", "`length_penalty` needs `use_beam_search` set to true.")
        if early not in (None, False):
            raise bad_request("early_stopping", "`early_stopping` needs `use_beam_search` set to true.")
        return (best_of if best_of is not None and best_of > n else None), None
    for name, off in _NOT_FOR_BEAMS.items():
        value = getattr(req, name)
        if value is not None and value not in off:
            raise bad_request(name, f"`{name}` does not apply to beam search (`use_beam_search`).")
    stopping = BeamStopping.DEFAULT if early is None else BeamStopping(early)
    return None, BeamSearch(best_of or n, length_penalty, stopping)
