"""A public ``Chat`` message rendered into a prompt: messages, tools and template variables for the template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from engine.text import Tokenizer
from proto.sluice.v1 import generation_pb2

# Names the renderer sets itself; a chat_template_kwargs entry may not replace them.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "chat_template", "special_tokens"})


@dataclass(frozen=True)
class ToolSpec:
    """A validated ``Tool``: ``parameters`` is a JSON object schema, or None when the function takes none."""

    name: str
    description: str
    parameters: dict[str, Any] | None

    def template_dict(self) -> dict[str, Any]:
        """The shape transformers' ``apply_chat_template(tools=...)`` passes JSON-schema tools in."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def tool_specs(chat: generation_pb2.Chat) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, tool in enumerate(chat.tools):
        if not tool.name:
            raise InvalidRequestError("tools", f"tools[{i}] has no function name")
        if any(s.name == tool.name for s in specs):
            raise InvalidRequestError("tools", f"tools[{i}]: the function name {tool.name!r} is used twice")
        parameters = None
        if tool.parameters:
            try:
                parameters = json.loads(tool.parameters)
            except ValueError as e:
                raise InvalidRequestError("tools", f"tools[{i}] ({tool.name}): parameters is not JSON: {e}") from e
            if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
                raise InvalidRequestError("tools", f"tools[{i}] ({tool.name}): parameters must be a JSON schema "
                                                   "of an object")
        specs.append(ToolSpec(tool.name, tool.description, parameters))
    return specs


@dataclass(frozen=True)
class ChatInputs:
    """What a chat template is rendered with, out of a public ``Chat``: plain Python values (JSON-able)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    request_template: str | None  # the request's own template; None: the service's / the model's
    kwargs: dict[str, Any]  # the template's variables: ``tools`` and chat_template_kwargs


def chat_inputs(chat: generation_pb2.Chat, *, with_parts: bool = False) -> ChatInputs:
    """``with_parts``: the caller renders messages' ``parts`` itself (services/tokenizer/multimodal.py); else a
    message with parts is refused naming them (this path renders ``content`` only)."""
    if not chat.messages:
        raise InvalidRequestError("messages", "at least one message is required")
    if not with_parts:
        for i, m in enumerate(chat.messages):
            if m.parts:
                raise InvalidRequestError(f"messages[{i}].parts", "content parts are not taken here (Generate and "
                                                                  "Tokenize take them, for a vision-language "
                                                                  "model)")
    tools = [s.template_dict() for s in tool_specs(chat)] or None
    return ChatInputs([_message(m) for m in chat.messages],
                      chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
                      chat.chat_template if chat.HasField("chat_template") else None,
                      {"tools": tools, **_template_kwargs(chat.chat_template_kwargs)})


def render_chat(tokenizer: Tokenizer, chat: generation_pb2.Chat, *, max_output_chars: int | None = None) -> str:
    """The prompt text, rendered here; the request's template wins over the service's (``--chat-template``,
    already the tokenizer's) and the model's. The service renders request templates elsewhere
    (``TemplateWorker``): this trusts the template it runs."""
    inputs = chat_inputs(chat)
    return tokenizer.apply_chat_template(inputs.messages, add_generation_prompt=inputs.add_generation_prompt,
                                         chat_template=inputs.request_template, max_output_chars=max_output_chars,
                                         **inputs.kwargs)


def _message(m: generation_pb2.ChatMessage) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.HasField("name"):
        msg["name"] = m.name
    if m.tool_calls:
        # A turn that only calls tools keeps "" for OpenAI's null content: templates that test it see it empty,
        # and the many that concatenate it do not fail on None.
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.HasField("tool_call_id"):
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _template_kwargs(raw: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        kwargs = json.loads(raw)
    except ValueError as e:
        raise InvalidRequestError("chat_template_kwargs", f"is not JSON: {e}") from e
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs", "must be a JSON object")
    reserved = sorted(_RESERVED & kwargs.keys())
    if reserved:
        raise InvalidRequestError("chat_template_kwargs", f"may not set {', '.join(reserved)} (set by the request)")
    return kwargs
