"""OpenAI function calling on the request side: ``tools``, ``tool_choice`` and the
``tool_calls`` / ``tool_call_id`` of the conversation's history."""

from __future__ import annotations

import json
from collections.abc import Mapping

from gateway.backend import Tool, ToolCall, ToolChoice, ToolChoiceMode
from gateway.errors import bad_request
from gateway.fields import json_type, opt_str

MAX_TOOLS = 128  # OpenAI's limit


def parse_tools(body: Mapping[str, object]) -> tuple[Tool, ...]:
    value = body.get("tools")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("tools", f"`tools` must be an array, got {json_type(value)}.")
    if len(value) > MAX_TOOLS:
        raise bad_request("tools", f"`tools` may hold at most {MAX_TOOLS} tools, got {len(value)}.")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(value))
    names = [t.name for t in tools]
    for i, tool_name in enumerate(names):
        if tool_name in names[:i]:
            raise bad_request(f"tools[{i}].function.name",
                              f"`tools[{i}].function.name` repeats the tool name {tool_name[:64]!r}.")
    return tools


def _tool(tool: object, name: str) -> Tool:
    if not isinstance(tool, dict):
        raise bad_request(name, f"`{name}` must be an object, got {json_type(tool)}.")
    if tool.get("type") != "function":
        raise bad_request(f"{name}.type", f"`{name}.type` must be \"function\" (the only kind of tool).")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{name}.function", f"`{name}.function` must be an object, got {json_type(fn)}.")
    fn_name = fn.get("name")
    if not isinstance(fn_name, str) or not fn_name:
        raise bad_request(f"{name}.function.name", f"`{name}.function.name` must be a non-empty string.")
    description = opt_str(fn, "description") or ""
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{name}.function.parameters",
                          f"`{name}.function.parameters` must be a JSON schema object, got {json_type(params)}.")
    if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
        raise bad_request(f"{name}.function.strict", f"`{name}.function.strict` must be a boolean.")
    return Tool(fn_name, description, "" if params is None else json.dumps(params, ensure_ascii=False))


def parse_tool_choice(body: Mapping[str, object], tools: tuple[Tool, ...]) -> ToolChoice | None:
    value = body.get("tool_choice")
    if value is None:
        return None
    if isinstance(value, str):
        modes = {"none": ToolChoiceMode.NONE, "auto": ToolChoiceMode.AUTO, "required": ToolChoiceMode.REQUIRED}
        if value not in modes:
            raise bad_request("tool_choice", "`tool_choice` must be \"none\", \"auto\", \"required\" or "
                                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                             f"got {value[:64]!r}.")
        choice = ToolChoice(modes[value])
    else:
        fn = value.get("function") if isinstance(value, dict) else None
        fn_name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(fn_name, str):
            raise bad_request("tool_choice", "`tool_choice` must be a string or "
                                             "{\"type\": \"function\", \"function\": {\"name\": ...}}.")
        if fn_name not in {t.name for t in tools}:
            raise bad_request("tool_choice", f"`tool_choice` names the function {fn_name[:64]!r}, which is not "
                                             "in `tools`.")
        choice = ToolChoice(ToolChoiceMode.FUNCTION, fn_name)
    if not tools and choice.mode is not ToolChoiceMode.NONE:
        raise bad_request("tool_choice", f"`tool_choice` {choice.mode.value!r} needs `tools`.")
    return choice


def parse_tool_calls(msg: Mapping[str, object], name: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``."""
    value = msg.get("tool_calls")
    if value is None:
        return ()
    field = f"{name}.tool_calls"
    if not isinstance(value, list):
        raise bad_request(field, f"`{field}` must be an array, got {json_type(value)}.")
    calls = []
    for i, call in enumerate(value):
        item = f"{field}[{i}]"
        if not isinstance(call, dict):
            raise bad_request(item, f"`{item}` must be an object, got {json_type(call)}.")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{item}.id", f"`{item}.id` must be a non-empty string.")
        if call.get("type", "function") != "function":
            raise bad_request(f"{item}.type", f"`{item}.type` must be \"function\".")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{item}.function", f"`{item}.function` must be an object, got {json_type(fn)}.")
        fn_name = fn.get("name")
        if not isinstance(fn_name, str) or not fn_name:
            raise bad_request(f"{item}.function.name", f"`{item}.function.name` must be a non-empty string.")
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):
            raise bad_request(f"{item}.function.arguments",
                              f"`{item}.function.arguments` must be a string (JSON text), got {json_type(arguments)}.")
        if not _is_json_object(arguments):  # the template gets them parsed
            raise bad_request(f"{item}.function.arguments",
                              f"`{item}.function.arguments` must be the JSON text of an object.")
        calls.append(ToolCall(call_id, fn_name, arguments))
    return tuple(calls)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False
