"""OpenAI (and vLLM-extension) request bodies, validated into the gateway's types.

Everything a client can get wrong is checked here, before any backend call,
and reported as a 400 naming the field. Unknown fields are ignored, as OpenAI
and vLLM do; known fields Sluice does not honour are refused by name, never
dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gateway.backend import BeamSearch, BeamStopping, ChatTurn, GenerationParams, Prompt, ToolChoiceMode
from gateway.errors import bad_request
from gateway.fields import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    UINT32_MAX,
    is_int,
    json_type,
    opt_bool,
    opt_float,
    opt_int,
    opt_object,
    opt_str,
    token_ids,
)
from gateway.guided import parse_guided
from gateway.tools import parse_tool_calls, parse_tool_choice, parse_tools

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_LENGTH = 256  # characters; the detokenizer holds back this much text
MAX_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one batched completions request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Known fields Sluice does not honour, and what to use instead.
_REFUSED = {
    "suffix": "`suffix` is not supported.",
    "structural_tag": "`structural_tag` is not supported; use `guided_grammar` or `response_format`.",
    "guided_whitespace_pattern": "`guided_whitespace_pattern` is not supported.",
    "functions": "`functions` (deprecated by OpenAI) is not supported; use `tools`.",
    "function_call": "`function_call` (deprecated by OpenAI) is not supported; use `tool_choice`.",
}
# Chat's fields, refused by completions (with a hint).
_CHAT_ONLY = {"tools": "", "tool_choice": "", "top_logprobs": " (completions take `logprobs`, an integer)"}
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


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: Prompt
    add_special_tokens: bool | None
    return_token_strs: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    token_ids: tuple[int, ...]


def parse_completion(body: Mapping[str, object], max_n: int) -> GenerationRequest:
    prompts = _prompts(body)
    for name, hint in _CHAT_ONLY.items():  # completions would ignore them
        if body.get(name) is not None:
            raise bad_request(name, f"`{name}` is for /v1/chat/completions{hint}.")
    logprobs = opt_int(body, "logprobs", 0, MAX_LOGPROBS)
    max_tokens = opt_int(body, "max_tokens", 1, UINT32_MAX)
    params = _params(body, max_n, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                     logprobs=logprobs is not None, top_logprobs=logprobs or 0, echo=bool(opt_bool(body, "echo")))
    stream, include_usage = _stream(body, params)
    return GenerationRequest(False, opt_str(body, "model"), prompts, params, stream, include_usage)


def parse_chat(body: Mapping[str, object], max_n: int) -> GenerationRequest:
    turns = _messages(body)
    logprobs = bool(opt_bool(body, "logprobs"))
    top_logprobs = opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs", "`top_logprobs` needs `logprobs` set to true.")
    max_tokens = opt_int(body, "max_completion_tokens", 1, UINT32_MAX)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", 1, UINT32_MAX)
    tools = parse_tools(body)
    tool_choice = parse_tool_choice(body, tools)
    params = _params(body, max_n, max_tokens, logprobs=logprobs, top_logprobs=top_logprobs or 0, echo=False)
    if params.guided is not None and tool_choice is not None and tool_choice.mode in (ToolChoiceMode.REQUIRED,
                                                                                      ToolChoiceMode.FUNCTION):
        raise bad_request("tool_choice", "`tool_choice` that forces a call constrains the output itself: it "
                                         "cannot be combined with `response_format` or guided decoding.")
    kwargs = opt_object(body, "chat_template_kwargs")
    params = replace(params, tool_choice=tool_choice, parallel_tool_calls=opt_bool(body, "parallel_tool_calls"))
    add_generation_prompt = opt_bool(body, "add_generation_prompt")
    prompt = Prompt(chat=turns, add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
                    tools=tools, chat_template=opt_str(body, "chat_template"),
                    chat_template_kwargs="" if kwargs is None else json.dumps(kwargs, ensure_ascii=False))
    stream, include_usage = _stream(body, params)
    # vLLM's chat echo: a conversation ending in an assistant turn is continued, and the answer repeats it.
    echo = bool(opt_bool(body, "echo")) and turns[-1].role == "assistant"
    return GenerationRequest(True, opt_str(body, "model"), (prompt,), params, stream, include_usage,
                             turns[-1].content if echo else "")


def parse_tokenize(body: Mapping[str, object]) -> TokenizeRequest:
    """vLLM's ``/tokenize``: ``prompt`` (a string) or chat ``messages`` (with ``tools``, ``chat_template`` and
    ``chat_template_kwargs``, rendered as a chat completion would render them)."""
    if body.get("messages") is not None:
        add_generation_prompt = opt_bool(body, "add_generation_prompt")
        kwargs = opt_object(body, "chat_template_kwargs")
        prompt = Prompt(chat=_messages(body),
                        add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
                        tools=parse_tools(body), chat_template=opt_str(body, "chat_template"),
                        chat_template_kwargs="" if kwargs is None else json.dumps(kwargs, ensure_ascii=False))
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad_request("prompt", f"`prompt` must be a string, got {json_type(text)}.")
        prompt = Prompt(text=text)
    return TokenizeRequest(opt_str(body, "model"), prompt, opt_bool(body, "add_special_tokens"),
                           bool(opt_bool(body, "return_token_strs")))


def parse_detokenize(body: Mapping[str, object]) -> DetokenizeRequest:
    return DetokenizeRequest(opt_str(body, "model"), token_ids(body.get("tokens"), "tokens", allow_empty=True))


def _stream(body: Mapping[str, object], params: GenerationParams) -> tuple[bool, bool]:
    stream = bool(opt_bool(body, "stream"))
    if stream and params.prompt_logprobs is not None:  # as vLLM: they would come before the first token
        raise bad_request("prompt_logprobs", "`prompt_logprobs` are not available when `stream` is true.")
    options = opt_object(body, "stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "`stream_options` is only allowed when `stream` is true.")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage",
                          f"`stream_options.include_usage` must be a boolean, got {json_type(include_usage)}.")
    return stream, bool(include_usage)


def _prompts(body: Mapping[str, object]) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    value = body.get("prompt")
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list) and value and all(is_int(v) for v in value):
        return (Prompt(token_ids=token_ids(value, "prompt")),)
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request("prompt", f"`prompt` must be a string, an array of strings or of token ids, "
                                    f"got {json_type(value)}.")
    if not items:
        raise bad_request("prompt", "`prompt` must not be empty.")
    if len(items) > MAX_PROMPTS:
        raise bad_request("prompt", f"`prompt` may hold at most {MAX_PROMPTS} prompts, got {len(items)}.")
    prompts = []
    for i, item in enumerate(items):
        name = "prompt" if isinstance(value, str) else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(name, f"`{name}` must not be empty.")
            prompts.append(Prompt(text=item))
        elif isinstance(item, list):
            prompts.append(Prompt(token_ids=token_ids(item, name)))
        else:
            raise bad_request(name, f"`{name}` must be a string or an array of token ids, got {json_type(item)}.")
    return tuple(prompts)


def _messages(body: Mapping[str, object]) -> tuple[ChatTurn, ...]:
    value = body.get("messages")
    if not isinstance(value, list):
        raise bad_request("messages", f"`messages` must be an array, got {json_type(value)}.")
    if not value:
        raise bad_request("messages", "`messages` must not be empty.")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))


def _message(msg: object, name: str) -> ChatTurn:
    if not isinstance(msg, dict):
        raise bad_request(name, f"`{name}` must be an object, got {json_type(msg)}.")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{name}.role", f"`{name}.role` must be one of {', '.join(CHAT_ROLES)}.")
    assert isinstance(role, str)
    content = msg.get("content")
    if content is None and role == "assistant":  # an assistant turn that only called tools
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_text_part(part, f"{name}.content[{i}]") for i, part in enumerate(content))
    else:
        raise bad_request(f"{name}.content",
                          f"`{name}.content` must be a string or an array of text parts, got {json_type(content)}.")
    author = opt_str(msg, "name")
    tool_calls = parse_tool_calls(msg, name)
    if tool_calls and role != "assistant":
        raise bad_request(f"{name}.tool_calls", f"`{name}.tool_calls` is only for assistant messages.")
    tool_call_id = opt_str(msg, "tool_call_id")
    if role == "tool" and not tool_call_id:
        raise bad_request(f"{name}.tool_call_id", f"`{name}.tool_call_id` is required for a tool message.")
    if role != "tool" and tool_call_id is not None:
        raise bad_request(f"{name}.tool_call_id", f"`{name}.tool_call_id` is only for tool messages.")
    # "developer" is OpenAI's newer name for the system role; templates know "system".
    return ChatTurn("system" if role == "developer" else role, text, author, tool_calls, tool_call_id)


def _text_part(part: object, name: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise bad_request(name, f"`{name}` must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                                "only text content is supported.")
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{name}.text", f"`{name}.text` must be a string, got {json_type(text)}.")
    return text


def _stop(body: Mapping[str, object]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop", f"`stop` must be a string or an array of strings, got {json_type(value)}.")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"`stop` may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    for s in stops:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise bad_request("stop", f"Each `stop` string must be 1 to {MAX_STOP_LENGTH} characters long.")
    return tuple(stops)


def _logit_bias(body: Mapping[str, object]) -> dict[int, float]:
    value = opt_object(body, "logit_bias")
    bias: dict[int, float] = {}
    for key, b in (value or {}).items():
        if not key.isdigit() or int(key) > UINT32_MAX:
            raise bad_request("logit_bias", f"`logit_bias` keys must be token ids, got {key[:32]!r}.")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad_request("logit_bias", f"`logit_bias` values must be numbers in [-100, 100], got {b!r:.32}.")
        bias[int(key)] = float(b)
    return bias


def _params(body: Mapping[str, object], max_n: int, max_tokens: int | None, *, logprobs: bool, top_logprobs: int,
            echo: bool) -> GenerationParams:
    for name, message in _REFUSED.items():
        if body.get(name) is not None:
            raise bad_request(name, message)
    opt_str(body, "user")  # accepted and unused, but it must be a string
    min_tokens = opt_int(body, "min_tokens", 0, UINT32_MAX) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request("min_tokens", f"`min_tokens` must be <= max_tokens ({max_tokens}), got {min_tokens}.")
    top_k = opt_int(body, "top_k", -1, UINT32_MAX)
    stop_token_ids = body.get("stop_token_ids")
    n = opt_int(body, "n", 1, max_n) or 1
    best_of, beam_search = _best_of_and_beam(body, n, max_n)
    return GenerationParams(
        n=n,
        temperature=opt_float(body, "temperature", 0.0, 2.0),
        top_p=opt_float(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=None if top_k in (None, -1, 0) else top_k,  # vLLM spells "disabled" 0 or -1
        min_p=opt_float(body, "min_p", 0.0, 1.0),
        presence_penalty=opt_float(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=opt_float(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=opt_float(body, "repetition_penalty", 0.0, 100.0, lo_open=True),
        logit_bias=_logit_bias(body),
        seed=opt_int(body, "seed", INT64_MIN, INT64_MAX),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(body),
        stop_token_ids=() if stop_token_ids is None else token_ids(stop_token_ids, "stop_token_ids", allow_empty=True),
        ignore_eos=bool(opt_bool(body, "ignore_eos")),
        include_stop_str_in_output=bool(opt_bool(body, "include_stop_str_in_output")),
        skip_special_tokens=opt_bool(body, "skip_special_tokens"),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        echo=echo,
        stream_interval=opt_int(body, "stream_interval", 1, UINT32_MAX),
        prompt_logprobs=opt_int(body, "prompt_logprobs", 0, MAX_LOGPROBS),
        guided=parse_guided(body),
        priority=opt_int(body, "priority", INT32_MIN, INT32_MAX) or 0,
        best_of=best_of,
        beam_search=beam_search,
    )


def _best_of_and_beam(body: Mapping[str, object], n: int, max_n: int) -> tuple[int | None, BeamSearch | None]:
    """``best_of`` (more candidates than ``n``), or beam search as vLLM spells it: ``use_beam_search``
    with ``best_of`` (else ``n``) beams, ``length_penalty`` and ``early_stopping``."""
    best_of = opt_int(body, "best_of", 1, max_n)
    if best_of is not None and best_of < n:
        raise bad_request("best_of", f"`best_of` must be >= n ({n}), got {best_of}.")
    length_penalty = opt_float(body, "length_penalty", -10.0, 10.0)
    early = body.get("early_stopping")
    if early is not None and not isinstance(early, bool) and early != "never":
        raise bad_request("early_stopping", "`early_stopping` must be true, false or \"never\".")
    if not opt_bool(body, "use_beam_search"):
        # Their defaults change nothing; any other value needs beams, so it is refused without them.
        if length_penalty not in (None, 1.0):
            raise bad_request("length_penalty", "`length_penalty` needs `use_beam_search` set to true.")
        if early not in (None, False):
            raise bad_request("early_stopping", "`early_stopping` needs `use_beam_search` set to true.")
        return (best_of if best_of is not None and best_of > n else None), None
    for name, off in _NOT_FOR_BEAMS.items():
        raw = body.get(name)
        if raw is not None and raw not in off:
            raise bad_request(name, f"`{name}` does not apply to beam search (`use_beam_search`).")
    stopping = BeamStopping.DEFAULT if early is None else BeamStopping(early)
    return None, BeamSearch(best_of or n, length_penalty, stopping)
