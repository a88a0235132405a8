"""A request's tool_choice: what the engine is asked to constrain, and how each sequence's text is read back.

vLLM's behaviour: unset tool_choice is "auto" with tools and "none" without; "auto" needs the service
started with ``--enable-auto-tool-choice`` and ``--tool-call-parser``; "required" and a named function
constrain the output with a JSON schema (guided decoding) and read the calls back from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from engine.text.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolCallStream, ToolParser
from proto.sluice.v1 import common_pb2, generation_pb2
from services.tokenizer.chat import ToolSpec, tool_specs

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSettings:
    """The service's flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: expected one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass(frozen=True)
class ToolPlan:
    """``parser`` reads each sequence's output (None: plain text); ``guided`` replaces the request's."""

    parser: ToolParser | None = None
    guided: common_pb2.GuidedDecoding | None = None

    def stream(self) -> ToolCallStream | None:
        return self.parser.stream() if self.parser is not None else None


def plan_tools(request: generation_pb2.GenerateRequest, settings: ToolSettings) -> ToolPlan:
    choice = request.tool_choice.WhichOneof("choice")
    if request.WhichOneof("input") != "chat":
        if choice is not None:
            raise InvalidRequestError("tool_choice", "needs chat input (messages)")
        if request.HasField("parallel_tool_calls"):
            raise InvalidRequestError("parallel_tool_calls", "needs chat input (messages) with tools")
        return ToolPlan()
    specs = tool_specs(request.chat)
    if choice is None:
        choice = "auto" if specs else "none"
    elif choice != "none" and not specs:
        raise InvalidRequestError("tool_choice", "needs tools")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    max_calls = None if parallel else 1
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise InvalidRequestError("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                                     "--tool-call-parser to be set")
        parameters = {s.name: s.parameters for s in specs if s.parameters is not None}
        return ToolPlan(TOOL_PARSERS[settings.tool_call_parser]([s.name for s in specs], max_calls,
                                                                parameters=parameters))
    if request.guided.WhichOneof("kind") is not None:
        raise InvalidRequestError("tool_choice", f"{choice.replace('function_name', 'a named function')} "
                                                 "constrains the output itself; it cannot be combined with guided")
    if choice == "required":
        schema = _required_schema(specs, parallel)
        return ToolPlan(RequiredToolParser([s.name for s in specs], max_calls), _json_schema(schema))
    name = request.tool_choice.function_name
    spec = next((s for s in specs if s.name == name), None)
    if spec is None:
        raise InvalidRequestError("tool_choice", f"names the function {name!r}, which is not among the tools")
    return ToolPlan(NamedToolParser(name), _json_schema(spec.parameters or _NO_PARAMETERS))


def _required_schema(specs: list[ToolSpec], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for "required": an array of ``{"name": <one tool>, "parameters": <its schema>}`` (and no
    other key), the tools' ``$defs`` hoisted to the top where their ``$ref``s point."""
    defs: dict[str, Any] = {}
    options = []
    for spec in specs:
        parameters = dict(spec.parameters or _NO_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise InvalidRequestError("tools", f"two tools define $defs {key!r} differently")
            defs[key] = value
        # Nothing but the two keys: an extra key would be a string the model could fill without end.
        options.append({"properties": {"name": {"type": "string", "enum": [spec.name]}, "parameters": parameters},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _json_schema(schema: dict[str, Any]) -> common_pb2.GuidedDecoding:
    return common_pb2.GuidedDecoding(json_schema=json.dumps(schema, ensure_ascii=False))
