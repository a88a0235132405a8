"""A ``POST /v1/responses`` body as the chat completions request it runs as.

``input`` (text, or message / function_call / function_call_output items), ``instructions`` (a system turn
first), function ``tools`` and ``tool_choice`` become chat ``messages``, ``tools`` and ``tool_choice``; the
conversation a ``previous_response_id`` ended comes before the new input. The chat body then goes through
the chat route's own parsing (gateway/schemas.py), so sampling, tools and templates behave exactly as chat's.
Known fields Sluice does not honour are refused by name; unknown ones are ignored, as OpenAI does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import bad_request
from gateway.fields import json_type, validate
from gateway.models import MAX_TOOLS, Int, JsonObject, Number
from gateway.responses_api.store import ChatMessages

MAX_INPUT_ITEMS = 4096
# Known Responses fields Sluice does not honour (when set to anything but null or their "off" value).
REFUSED = {
    "background": "`background` responses are not supported: send the request and wait for it (or stream it).",
    "conversation": "`conversation` is not supported; use `previous_response_id` or send the history as `input`.",
    "prompt": "`prompt` (stored prompt templates) is not supported; send `instructions` and `input`.",
    "max_tool_calls": "`max_tool_calls` is not supported.",
    "include": "`include` is not supported.",
    "reasoning": "`reasoning` is not supported: whether a model thinks is the server's --reasoning-parser.",
    "top_logprobs": "`top_logprobs` is not supported on /v1/responses; use /v1/chat/completions.",
    "prompt_cache_key": "`prompt_cache_key` is not supported: prefix caching is automatic.",
}
_OFF: dict[str, tuple[object, ...]] = {"background": (False,), "include": ([],), "truncation": ("disabled",)}


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ResponsesRequest(_Model):
    """The fields of ``POST /v1/responses`` that are read here; ``input``'s items are read by hand below."""

    model: str | None = None
    input: str | list[JsonObject]
    instructions: str | None = None
    tools: list[JsonObject] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: JsonObject | None = None
    truncation: str | None = None
    cache_salt: str | None = None   # vLLM's, passed to chat (which checks it)


@dataclass(frozen=True)
class ResponsesCall:
    """A validated Responses request: the chat body to run, and what the response echoes."""

    request: ResponsesRequest
    chat_body: dict[str, object]
    new_messages: ChatMessages  # the conversation, less instructions: what the store keeps with the output

    @property
    def store(self) -> bool:
        return self.request.store is not False


def parse_responses(body: Mapping[str, object], history: ChatMessages) -> ResponsesCall:
    """``history``: the conversation ``previous_response_id`` names (looked up by the caller), else ()."""
    for name, message in REFUSED.items():
        value = body.get(name)
        if value is not None and value not in _OFF.get(name, ()):
            raise bad_request(name, message)
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation", '`truncation` "auto" is not supported: a prompt longer than the context '
                                        "is refused.")
    req = validate(ResponsesRequest, body)
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else _messages(req.input)
    messages = (*history, *items)
    chat: dict[str, object] = {"messages": ([{"role": "system", "content": req.instructions}]
                                            if req.instructions else []) + list(messages)}
    for name in ("model", "parallel_tool_calls", "temperature", "top_p", "stream", "user", "cache_salt"):
        value = getattr(req, name)
        if value is not None:
            chat[name] = value
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.text is not None:
        response_format = _text_format(req.text)
        if response_format is not None:
            chat["response_format"] = response_format
    return ResponsesCall(req, chat, messages)


# Chat's names for the fields converted above, as the Responses request names them (in a 400's ``param``).
_CHAT_NAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema.", "text.format."),
               ("response_format", "text.format"))


def responses_param(param: str | None) -> str | None:
    """A chat field's name in an error, as the Responses request spells it: ``tools[0].function.parameters`` is
    ``tools[0].parameters``. A conversation turn keeps its chat name (``messages[2]``): with instructions and
    ``previous_response_id`` a turn is not one ``input`` item."""
    if param is None:
        return None
    if param.startswith("tools[") and "].function." in param:
        return param.replace("].function.", "].", 1)
    for chat, responses in _CHAT_NAMES:
        if param == chat or (chat.endswith(".") and param.startswith(chat)):
            return responses + param[len(chat):]
    return param


def _messages(items: list[JsonObject]) -> list[dict[str, object]]:
    if len(items) > MAX_INPUT_ITEMS:
        raise bad_request("input", f"`input` has more than {MAX_INPUT_ITEMS} items.")
    out: list[dict[str, object]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role", f'`{where}.role` must be "user", "system", "developer" or '
                                                   f'"assistant".')
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # parallel calls: one assistant turn
                calls = last.setdefault("tool_calls", [])
                assert isinstance(calls, list)
                calls.append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # a model's earlier thinking: chat templates do not take it back (as vLLM)
        else:
            raise bad_request(f"{where}.type", f"`{where}.type` {str(kind)[:64]!r} is not supported: input items are "
                                               '"message", "function_call", "function_call_output" and "reasoning".')
    return out


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise bad_request(f"{where}.{key}", f"`{where}.{key}` must be a non-empty string, got {json_type(value)}.")
    return value


def _content(content: object, where: str) -> str | list[dict[str, object]]:
    """A message's content: text (as ``_text``), or, when it has ``input_image`` parts, chat's content array (text
    and ``image_url`` parts in order), so that images take chat's path (gateway/multimodal.py) to the tokenizer
    service."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where)
    parts: list[dict[str, object]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            parts.append(_image_part(part, f"{where}[{j}]"))
        else:
            parts.append({"type": "text", "text": _text([part], where, j)})
    return parts


def _image_part(part: Mapping[str, Any], where: str) -> dict[str, object]:
    """OpenAI's ``{"type": "input_image", "image_url": "data:...", "detail": "auto"}`` as chat's image_url part."""
    if part.get("file_id") is not None:
        raise bad_request(f"{where}.file_id", f"`{where}.file_id` is not supported (there is no files API): send "
                                              "the image as `image_url`, a data: URL.")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.image_url", f"`{where}.image_url` must be a non-empty string (a data: URL), got "
                                                f"{json_type(url)}.")
    image: dict[str, object] = {"url": url}
    if part.get("detail") is not None:
        image["detail"] = part["detail"]   # chat's schema checks it
    return {"type": "image_url", "image_url": image}


def _text(content: object, where: str, first: int = 0) -> str:
    """Text content: a string, or input_text / output_text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, f"`{where}` must be a string or an array of text parts, got {json_type(content)}.")
    texts = []
    for j, part in enumerate(content, first):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]", f'`{where}[{j}]` must be an "input_text" or "output_text" part: only '
                                               'text content (and "input_image" in a message) is supported.')
        texts.append(part["text"])
    return "".join(texts)


def _tool(i: int, tool: JsonObject) -> dict[str, object]:
    if tool.get("type") != "function":
        raise bad_request(f"tools[{i}].type", f"`tools[{i}].type` {str(tool.get('type'))[:64]!r} is not supported: "
                                              "only function tools are.")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(value: str | JsonObject) -> object:
    if isinstance(value, str):
        return value  # "none", "auto", "required": chat's own check names anything else
    if value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise bad_request("tool_choice", f"`tool_choice` of type {str(value.get('type'))[:64]!r} is not supported: use "
                                     '"none", "auto", "required" or {"type": "function", "name": ...}.')


def _text_format(text: JsonObject) -> dict[str, object] | None:
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request("text.format", '`text.format` must be of type "text", "json_object" or "json_schema".')
