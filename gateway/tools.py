"""OpenAI function calling on the request side: ``tools``, ``tool_choice`` and the
``tool_calls`` of the conversation's history, from their validated models to the backend's types.

Shapes and types are the models' (gateway/models.py); what is checked here spans
fields: names that repeat, a ``tool_choice`` naming a function not in ``tools``,
arguments that are not the JSON text of an object."""

from __future__ import annotations

import json

from gateway.backend import Tool, ToolCall, ToolChoice, ToolChoiceMode
from gateway.errors import bad_request
from gateway.models import ToolCall as ToolCallModel
from gateway.models import ToolChoiceArg, ToolDefinition


def to_tools(value: list[ToolDefinition] | None) -> tuple[Tool, ...]:
    tools = tuple(Tool(t.function.name, t.function.description or "",
                       "" if t.function.parameters is None else json.dumps(t.function.parameters, ensure_ascii=False))
                  for t in value or ())
    names = [t.name for t in tools]
    for i, tool_name in enumerate(names):
        if tool_name in names[:i]:
            raise bad_request(f"tools[{i}].function.name",
                              f"`tools[{i}].function.name` repeats the tool name {tool_name[:64]!r}.")
    return tools


def to_tool_choice(value: ToolChoiceArg | None, tools: tuple[Tool, ...]) -> ToolChoice | None:
    if value is None:
        return None
    if isinstance(value, str):
        choice = ToolChoice(ToolChoiceMode(value))
    else:
        fn_name = value.function.name
        if fn_name not in {t.name for t in tools}:
            raise bad_request("tool_choice", f"`tool_choice` names the function {fn_name[:64]!r}, which is not "
                                             "in `tools`.")
        choice = ToolChoice(ToolChoiceMode.FUNCTION, fn_name)
    if not tools and choice.mode is not ToolChoiceMode.NONE:
        raise bad_request("tool_choice", f"`tool_choice` {choice.mode.value!r} needs `tools`.")
    return choice


def to_tool_calls(value: list[ToolCallModel] | None, name: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``; ``name`` is the message's path (``messages[1]``)."""
    calls = []
    for i, call in enumerate(value or ()):
        if not _is_json_object(call.function.arguments):  # the template gets them parsed
            field = f"{name}.tool_calls[{i}].function.arguments"
            raise bad_request(field, f"`{field}` must be the JSON text of an object.")
        calls.append(ToolCall(call.id, call.function.name, call.function.arguments))
    return tuple(calls)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False
