"""services/tokenizer/tools.py: what tool_choice asks of the engine, which parser reads the output, refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.errors import InvalidRequestError
from engine.text.tool_parsers import HermesToolParser, NamedToolParser, RequiredToolParser
from proto.sluice.v1 import common_pb2, generation_pb2
from services.tokenizer.tools import ToolSettings, plan_tools

WEATHER_PARAMS = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
WEATHER = generation_pb2.Tool(name="get_weather", description="Weather now", parameters=json.dumps(WEATHER_PARAMS))
TIME = generation_pb2.Tool(name="get_time")  # no parameters
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat_request(*tools: generation_pb2.Tool, **kw: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(chat=generation_pb2.Chat(
        messages=[generation_pb2.ChatMessage(role="user", content="hi")], tools=tools), **kw)


def required_schema(request: generation_pb2.GenerateRequest) -> dict[str, object]:
    plan = plan_tools(request, ToolSettings())
    assert isinstance(plan.parser, RequiredToolParser) and plan.guided is not None
    return json.loads(plan.guided.json_schema)


def test_required_asks_for_vllms_array_of_calls() -> None:
    schema = required_schema(chat_request(WEATHER, TIME, tool_choice=generation_pb2.ToolChoice(required=True)))
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER_PARAMS},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"], "additionalProperties": False}]}}
    jsonschema.validate([{"name": "get_weather", "parameters": {"location": "Oslo"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "rm", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_without_parallel_calls_allows_one_and_hoists_defs() -> None:
    with_defs = generation_pb2.Tool(name="move", parameters=json.dumps({
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "$defs": {"point": {"type": "array"}}}))
    schema = required_schema(chat_request(with_defs, tool_choice=generation_pb2.ToolChoice(required=True),
                                          parallel_tool_calls=False))
    assert schema["maxItems"] == 1 and schema["$defs"] == {"point": {"type": "array"}}
    jsonschema.validate([{"name": "move", "parameters": {"to": [1, 2]}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"to": "x"}}], schema)


def test_a_named_function_asks_for_its_parameters() -> None:
    plan = plan_tools(chat_request(WEATHER, TIME, tool_choice=generation_pb2.ToolChoice(function_name="get_weather")),
                      ToolSettings())
    assert isinstance(plan.parser, NamedToolParser) and plan.parser.name == "get_weather"
    assert plan.guided == common_pb2.GuidedDecoding(json_schema=json.dumps(WEATHER_PARAMS))
    plan = plan_tools(chat_request(TIME, tool_choice=generation_pb2.ToolChoice(function_name="get_time")),
                      ToolSettings())
    assert plan.guided is not None and json.loads(plan.guided.json_schema) == {"type": "object", "properties": {}}


def test_auto_is_the_default_with_tools_and_uses_the_services_parser() -> None:
    plan = plan_tools(chat_request(WEATHER), AUTO)
    assert isinstance(plan.parser, HermesToolParser) and plan.guided is None
    assert plan.parser.tool_names == {"get_weather"} and plan.parser.max_calls is None
    assert plan.parser.parameters == {"get_weather": WEATHER_PARAMS}  # for formats the schema types (qwen3_coder)
    plan = plan_tools(chat_request(WEATHER, parallel_tool_calls=False), AUTO)
    assert plan.parser is not None and plan.parser.max_calls == 1


def test_none_and_no_tools_parse_nothing() -> None:
    assert plan_tools(chat_request(), AUTO).parser is None
    assert plan_tools(chat_request(WEATHER, tool_choice=generation_pb2.ToolChoice(none=True)), ToolSettings()
                      ).parser is None
    assert plan_tools(generation_pb2.GenerateRequest(text="hi"), AUTO).parser is None


@pytest.mark.parametrize("request_, settings, field, fragment", [
    (chat_request(WEATHER), ToolSettings(), "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    (chat_request(WEATHER, tool_choice=generation_pb2.ToolChoice(function_name="nope")), AUTO, "tool_choice",
     "'nope', which is not among the tools"),
    (chat_request(tool_choice=generation_pb2.ToolChoice(required=True)), AUTO, "tool_choice", "needs tools"),
    (generation_pb2.GenerateRequest(text="hi", tool_choice=generation_pb2.ToolChoice(auto=True)), AUTO,
     "tool_choice", "needs chat input"),
    (generation_pb2.GenerateRequest(text="hi", parallel_tool_calls=False), AUTO, "parallel_tool_calls",
     "needs chat input"),
    (chat_request(WEATHER, tool_choice=generation_pb2.ToolChoice(required=True),
                  guided=common_pb2.GuidedDecoding(regex="a+")), AUTO, "tool_choice", "cannot be combined with guided"),
    (chat_request(WEATHER, tool_choice=generation_pb2.ToolChoice(function_name="get_weather"),
                  guided=common_pb2.GuidedDecoding(json_object=True)), AUTO, "tool_choice", "a named function"),
    (chat_request(generation_pb2.Tool(name="f", parameters='{"type": "string"}')), AUTO, "tools",
     "parameters must be a JSON schema of an object"),
    (chat_request(generation_pb2.Tool(name="f", parameters="[1]")), AUTO, "tools", "JSON schema of an object"),
    (chat_request(generation_pb2.Tool(name="f", parameters="{")), AUTO, "tools", "parameters is not JSON"),
    (chat_request(WEATHER, WEATHER), AUTO, "tools", "'get_weather' is used twice"),
    (chat_request(generation_pb2.Tool(description="x")), AUTO, "tools", "tools[0] has no function name"),
])
def test_refusals_name_the_field(request_: generation_pb2.GenerateRequest, settings: ToolSettings, field: str,
                                 fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        plan_tools(request_, settings)
    assert info.value.field == field and fragment in info.value.message


def test_settings_refuse_auto_without_a_parser_and_unknown_parsers() -> None:
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="expected one of deepseek_v3, deepseek_v31, hermes, llama3_json, mistral, "
                                         "pythonic, qwen3_coder"):
        ToolSettings(tool_call_parser="granite")
