"""The call formats of each family the parsers read, as the models' chat templates and vLLM's tests show them:
a single call, parallel calls, text around the calls, non-ASCII text, and the ways outputs go wrong.

Each case is what the model wrote and what a client must get: the content, and each call's name and
arguments — a JSON object (compared as parsed JSON), or ``Cut`` text where the output broke off inside the
arguments (compared as text: what was sent before the break).

Sources: Qwen2.5 / Hermes function-calling docs and chat template (hermes); Meta's Llama 3.1 / 3.2 prompt
formats (llama3_json, pythonic); mistral-common's v3, v11 and v13 chat templates and vLLM's mistral tests
(mistral); Qwen3-Coder's chat template and vLLM's qwen3_coder / qwen3_xml tests (qwen3_coder); DeepSeek-V3's
and V3.1's chat templates and vLLM's deepseek_v3 / deepseek_v31 tests (deepseek_v3); vLLM's pythonic tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cut:
    """Arguments that broke off: the exact text sent before the break."""

    text: str


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    text: str
    content: str
    calls: tuple[tuple[str, dict[str, Any] | Cut], ...] = ()
    max_calls: int | None = None

    @property
    def id(self) -> str:
        return f"{self.family}: {self.name}"

    @property
    def calls_whole(self) -> bool:
        return not any(isinstance(args, Cut) for _, args in self.calls[:self.max_calls])


TOOLS = ("get_current_weather", "get_time", "get_weather", "search_hotels", "send_message", "add", "multiply",
         "get_age", "write_file", "register_user", "get_current_time", "foo", "bar", "typed")

# The schemas a format that writes values as text (qwen3_coder) types them by.
PARAMETERS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
    "typed": {"type": "object", "properties": {
        "count": {"type": "integer"}, "ratio": {"type": "number"}, "flag": {"type": "boolean"},
        "data": {"type": "object"}, "items": {"type": "array"}, "label": {"type": "string"},
        "maybe": {"type": ["string", "null"]}, "choice": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
}

PARIS = {"location": "Paris, France", "unit": "celsius"}
TOKYO = {"timezone": "Asia/Tokyo"}
CODE = 'def greet(name):\n    """Say hello."""\n    print(f"Hello, {name}! \\\\o/")\n    return {"ok": True}'

# ---- hermes ----------------------------------------------------------------------------------------------
H_PARIS = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
           '"unit": "celsius"}}\n</tool_call>')
H_TOKYO = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>'

HERMES = [
    Case("hermes", "single", H_PARIS, "", (("get_current_weather", PARIS),)),
    Case("hermes", "parallel", f"{H_PARIS}\n{H_TOKYO}", "", (("get_current_weather", PARIS), ("get_time", TOKYO))),
    Case("hermes", "text before", f"Let me check both for you.\n{H_PARIS}\n{H_TOKYO}\n",
         "Let me check both for you.\n", (("get_current_weather", PARIS), ("get_time", TOKYO))),
    Case("hermes", "text after", f"{H_TOKYO}\nDone.", "\nDone.", (("get_time", TOKYO),)),
    Case("hermes", "unicode", '<tool_call>\n{"name": "send_message", "arguments": {"to": "Zoë", "text": '
         '"東京は晴れ ☀️ — 25°C"}}\n</tool_call>', "",
         (("send_message", {"to": "Zoë", "text": "東京は晴れ ☀️ — 25°C"}),)),
    Case("hermes", "escaped strings", '<tool_call>\n{"name": "send_message", "arguments": {"text": "He said '
         '\\"hi\\"\\nthen left", "path": "C:\\\\Users\\\\zoe", "emoji": "\\ud83d\\ude00"}}\n</tool_call>', "",
         (("send_message", {"text": 'He said "hi"\nthen left', "path": "C:\\Users\\zoe", "emoji": "😀"}),)),
    Case("hermes", "nested arguments and other keys", '<tool_call>\n{"id": 7, "name": "register_user", '
         '"arguments": {"user": {"name": "Ann", "tags": ["a", [1, 2.5e3, -0.5]], "ok": true, "none": null}}, '
         '"type": "function"}\n</tool_call>', "",
         (("register_user", {"user": {"name": "Ann", "tags": ["a", [1, 2500.0, -0.5]], "ok": True,
                                      "none": None}}),)),
    Case("hermes", "arguments before the name", '<tool_call>{"arguments": {"name": "John Doe"}, "name": "get_age"}'
         '</tool_call>', "", (("get_age", {"name": "John Doe"}),)),
    Case("hermes", "no arguments", '<tool_call>{"name": "get_current_time"}</tool_call>', "",
         (("get_current_time", {}),)),
    Case("hermes", "no call", "The weather in Paris is mild today.", "The weather in Paris is mild today."),
    Case("hermes", "a lone angle bracket", "x < y and <tool is not a tag", "x < y and <tool is not a tag"),
    Case("hermes", "malformed: bad JSON before the arguments",
         '<tool_call>\n{"name": "get_time" "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "get_time" "arguments": {}}\n</tool_call>'),
    Case("hermes", "malformed: unknown name", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    Case("hermes", "malformed: arguments as a string",
         '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>',
         '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>'),
    Case("hermes", "malformed: a bad block between good ones", f"{H_PARIS}\n<tool_call>oops</tool_call>\n{H_TOKYO}",
         "<tool_call>oops</tool_call>", (("get_current_weather", PARIS), ("get_time", TOKYO))),
    Case("hermes", "malformed: the object left open before the end tag",
         '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}\n</tool_call>', "",
         (("get_time", {"timezone": "UTC"}),)),
    Case("hermes", "malformed: broken inside the arguments",
         '<tool_call>\n{"name": "get_time", "arguments": {"timezone": UTC}}\n</tool_call>\nok', "\nok",
         (("get_time", Cut('{"timezone": ')),)),
    Case("hermes", "cut before the call is known", f"{H_PARIS}\n<tool_call>\n{{\"name\": \"get_ti",
         '<tool_call>\n{"name": "get_ti', (("get_current_weather", PARIS),)),
    Case("hermes", "cut inside the arguments", '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asi',
         "", (("get_time", Cut('{"timezone": "Asi')),)),
    Case("hermes", "parallel_tool_calls false", f"{H_PARIS}\n{H_TOKYO}", "", (("get_current_weather", PARIS),),
         max_calls=1),
]

# ---- llama3_json -----------------------------------------------------------------------------------------
L_PARIS = '{"name": "get_current_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}'
L_TOKYO = '{"name": "get_time", "parameters": {"timezone": "Asia/Tokyo"}}'

LLAMA3 = [
    Case("llama3_json", "single", L_PARIS, "", (("get_current_weather", PARIS),)),
    Case("llama3_json", "parallel", f"{L_PARIS}; {L_TOKYO}", "", (("get_current_weather", PARIS), ("get_time", TOKYO))),
    Case("llama3_json", "python_tag", f"<|python_tag|>{L_TOKYO}", "", (("get_time", TOKYO),)),
    Case("llama3_json", "python_tag, parallel, whitespace", f"\n<|python_tag|>{L_PARIS};\n{L_TOKYO}\n", "",
         (("get_current_weather", PARIS), ("get_time", TOKYO))),
    Case("llama3_json", "arguments key", '{"name": "get_time", "arguments": {"timezone": "UTC"}}', "",
         (("get_time", {"timezone": "UTC"}),)),
    Case("llama3_json", "unicode", '{"name": "send_message", "parameters": {"text": "Grüße aus Köln 🍺"}}', "",
         (("send_message", {"text": "Grüße aus Köln 🍺"}),)),
    Case("llama3_json", "plain answer", "It is 9 am in Tokyo.", "It is 9 am in Tokyo."),
    Case("llama3_json", "text before the call (the format has none: content)", f"Sure! {L_TOKYO}",
         f"Sure! {L_TOKYO}"),
    Case("llama3_json", "a trailing separator", f"{L_TOKYO};", "", (("get_time", TOKYO),)),
    Case("llama3_json", "text after a call", f"{L_TOKYO}; and then", "; and then", (("get_time", TOKYO),)),
    Case("llama3_json", "malformed: bad JSON before the arguments", '{"name": "get_time" "parameters": {}}',
         '{"name": "get_time" "parameters": {}}'),
    Case("llama3_json", "malformed: unknown name", '{"name": "send_email", "parameters": {}}',
         '{"name": "send_email", "parameters": {}}'),
    Case("llama3_json", "malformed: JSON that is not a call", '{"temperature": 21}', '{"temperature": 21}'),
    Case("llama3_json", "malformed: a good call, then one that is not", f'{L_TOKYO}; {{"name": "nope"}}',
         '; {"name": "nope"}', (("get_time", TOKYO),)),
    Case("llama3_json", "malformed: the object left open", '{"name": "get_time", "parameters": {"timezone": "UTC"}',
         "", (("get_time", {"timezone": "UTC"}),)),
    Case("llama3_json", "cut inside the arguments", '{"name": "get_time", "parameters": {"time', "",
         (("get_time", Cut('{"time')),)),
]

# ---- mistral ---------------------------------------------------------------------------------------------
WEATHER_SF = {"city": "San Francisco", "state": "CA", "unit": "celsius"}

MISTRAL = [
    Case("mistral", "pre-v11: single", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', "",
         (("add", {"a": 3.5, "b": 4}),)),
    Case("mistral", "pre-v11: parallel, with ids (v3 template)",
         '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"city": "San Francisco", "state": "CA", '
         '"unit": "celsius"}, "id": "a1b2c3d4e"}, {"name": "add", "arguments": {"a": 1, "b": 2}, "id": "f5g6h7i8j"}]',
         "", (("get_current_weather", WEATHER_SF), ("add", {"a": 1, "b": 2}))),
    Case("mistral", "pre-v11: text before", 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
         "Hello", (("add", {"a": 1, "b": 2}),)),
    Case("mistral", "pre-v11: arguments before the name",
         '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', "",
         (("get_age", {"name": "John Doe"}),)),
    Case("mistral", "pre-v11: text after the array",
         '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas"}}]\nextra trailing data',
         "\nextra trailing data", (("get_current_weather", {"city": "Dallas"}),)),
    Case("mistral", "v13: single", '[TOOL_CALLS]get_current_weather[ARGS]{"city": "San Francisco", "state": "CA", '
         '"unit": "celsius"}', "", (("get_current_weather", WEATHER_SF),)),
    Case("mistral", "v13: parallel, text before", 'Let me compute.[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}'
         '[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}', "Let me compute.",
         (("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6}))),
    Case("mistral", "v11: call ids", '[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}[TOOL_CALLS]multiply'
         '[CALL_ID]f5g6h7i8j[ARGS]{"b": 2}', "", (("add", {"a": 1}), ("multiply", {"b": 2}))),
    Case("mistral", "v11: [ARGS] dropped by the decoder",
         '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3}', "",
         (("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3}))),
    Case("mistral", "unicode", '[TOOL_CALLS]send_message[ARGS]{"text": "Ça va? Привет! 👋"}', "",
         (("send_message", {"text": "Ça va? Привет! 👋"}),)),
    Case("mistral", "no call", "This is a test", "This is a test"),
    Case("mistral", "malformed: not JSON at all", "[TOOL_CALLS] not json at all", "[TOOL_CALLS] not json at all"),
    Case("mistral", "malformed: unknown name", '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}',
         '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}'),
    Case("mistral", "malformed: an unknown call, then a good one",
         '[TOOL_CALLS]rm_rf[ARGS]{}[TOOL_CALLS]add[ARGS]{"a": 1}', "[TOOL_CALLS]rm_rf[ARGS]{}", (("add", {"a": 1}),)),
    Case("mistral", "malformed: pre-v11, bad JSON before the arguments",
         '[TOOL_CALLS][{"name": "add" "arguments": {}}]', '[TOOL_CALLS][{"name": "add" "arguments": {}}]'),
    Case("mistral", "malformed: an empty array", "[TOOL_CALLS][]", "[TOOL_CALLS][]"),
    Case("mistral", "malformed: broken inside the arguments", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": two}'
         '[TOOL_CALLS]multiply[ARGS]{"a": 2}', "", (("add", Cut('{"a": 1, "b": ')), ("multiply", {"a": 2}))),
    Case("mistral", "cut inside the arguments", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b"', "",
         (("add", Cut('{"a": 1, "b"')),)),
    Case("mistral", "cut after the marker", "Sure.[TOOL_CALLS]", "Sure.[TOOL_CALLS]"),
]

# ---- qwen3_coder -----------------------------------------------------------------------------------------


def q_call(function: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={name}>\n{value}\n</parameter>\n" for name, value in params)
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


Q_SF = q_call("get_weather", ("city", "San Francisco"), ("days", "3"))
Q_TOKYO = q_call("get_time", ("timezone", "Asia/Tokyo"))

QWEN3_CODER = [
    Case("qwen3_coder", "single", Q_SF, "", (("get_weather", {"city": "San Francisco", "days": 3}),)),
    Case("qwen3_coder", "parallel", f"{Q_SF}\n{Q_TOKYO}", "",
         (("get_weather", {"city": "San Francisco", "days": 3}), ("get_time", TOKYO))),
    Case("qwen3_coder", "text before", f"I'll check the weather.\n{Q_SF}", "I'll check the weather.\n",
         (("get_weather", {"city": "San Francisco", "days": 3}),)),
    Case("qwen3_coder", "code in a value", q_call("write_file", ("path", "src/greet.py"), ("content", CODE)), "",
         (("write_file", {"path": "src/greet.py", "content": CODE}),)),
    Case("qwen3_coder", "unicode", q_call("send_message", ("text", "Grüße aus 東京 🍣")), "",
         (("send_message", {"text": "Grüße aus 東京 🍣"}),)),
    Case("qwen3_coder", "values typed by the schema",
         q_call("typed", ("count", "42"), ("ratio", "3.25"), ("flag", "True"), ("data", '{"key": "val", "n": 1}'),
                ("items", "['a', 'b', 3]"), ("label", "null"), ("maybe", "nullable"), ("choice", "7")), "",
         (("typed", {"count": 42, "ratio": 3.25, "flag": True, "data": {"key": "val", "n": 1},
                     "items": ["a", "b", 3], "label": None, "maybe": "nullable", "choice": 7}),)),
    Case("qwen3_coder", "values that do not read as their type stay text",
         q_call("typed", ("count", "many"), ("flag", "maybe"), ("data", "{not json"), ("ratio", "inf")), "",
         (("typed", {"count": "many", "flag": "maybe", "data": "{not json", "ratio": "inf"}),)),
    Case("qwen3_coder", "parameters the schema does not know are text", q_call("foo", ("x", "1"), ("y", "[2]")), "",
         (("foo", {"x": "1", "y": "[2]"}),)),
    Case("qwen3_coder", "markup in a value", q_call("send_message", ("text", "<b>bold</b> a < b </param> <tool_call")),
         "", (("send_message", {"text": "<b>bold</b> a < b </param> <tool_call"}),)),
    Case("qwen3_coder", "empty and blank-line values", q_call("send_message", ("to", ""), ("text", "\nx\n")), "",
         (("send_message", {"to": "", "text": "\nx\n"}),)),
    Case("qwen3_coder", "no parameters", "<tool_call>\n<function=get_current_time>\n</function>\n</tool_call>", "",
         (("get_current_time", {}),)),
    Case("qwen3_coder", "no </parameter> before the next parameter",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>",
         "", (("get_weather", {"city": "Oslo", "days": 2}),)),
    Case("qwen3_coder", "no call", "def f():\n    return 1 < 2", "def f():\n    return 1 < 2"),
    Case("qwen3_coder", "malformed: no <function=", "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>",
         "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>"),
    Case("qwen3_coder", "malformed: unknown function", q_call("rm_rf", ("path", "/")), q_call("rm_rf", ("path", "/"))),
    Case("qwen3_coder", "malformed: </tool_call> before </function>",
         "<tool_call>\n<function=get_time>\n<parameter=timezone>\nUTC\n</parameter>\n</tool_call>\nok", "\nok",
         (("get_time", {"timezone": "UTC"}),)),
    Case("qwen3_coder", "cut inside a string value",
         "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=content>\nline 1\nli",
         "", (("write_file", Cut('{"path": "a.txt", "content": "line 1\\nli')),)),
    Case("qwen3_coder", "cut inside a typed value",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n1",
         "", (("get_weather", Cut('{"city": "Oslo", "days": ')),)),
    Case("qwen3_coder", "cut before the call is known", "Sure.\n<tool_call>\n<function=get_wea",
         "Sure.\n<tool_call>\n<function=get_wea"),
]

# ---- deepseek_v3 -----------------------------------------------------------------------------------------
B, E, CB, CE, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>")


def v3_call(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


def v31_call(name: str, args: str) -> str:
    return f"{CB}{name}{SEP}{args}{CE}"


TOKYO_V3 = '{"city": "Tokyo", "unit": "celsius"}'
HOTELS = '{"location": "Tokyo", "check_in": "2025-01-15"}'
ESCAPED = ('{"text": "He said \\"hello\\"", "path": "C:\\\\Users", "n": 42, "f": 3.14, "ok": true, '
           '"none": null, "list": [], "obj": {}}')

DEEPSEEK = [
    Case("deepseek_v3", "V3: single", B + v3_call("get_weather", TOKYO_V3) + E, "",
         (("get_weather", {"city": "Tokyo", "unit": "celsius"}),)),
    Case("deepseek_v3", "V3: parallel", B + v3_call("get_weather", '{"city": "Tokyo"}') + "\n"
         + v3_call("search_hotels", HOTELS) + E, "",
         (("get_weather", {"city": "Tokyo"}), ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"}))),
    Case("deepseek_v3", "V3: text before", "Let me check the weather for you." + B
         + v3_call("get_weather", '{"city": "Paris"}') + E, "Let me check the weather for you.",
         (("get_weather", {"city": "Paris"}),)),
    Case("deepseek_v3", "V3: escaped strings and types", B + v3_call("send_message", ESCAPED) + E, "",
         (("send_message", {"text": 'He said "hello"', "path": "C:\\Users", "n": 42, "f": 3.14, "ok": True,
                            "none": None, "list": [], "obj": {}}),)),
    Case("deepseek_v3", "V3: empty arguments", B + v3_call("get_current_time", "{}") + E, "",
         (("get_current_time", {}),)),
    Case("deepseek_v3", "V3: unicode", B + v3_call("send_message", '{"text": "你好，世界 🌏"}') + E, "",
         (("send_message", {"text": "你好，世界 🌏"}),)),
    Case("deepseek_v3", "V3.1: single", "normal text" + B + v31_call("foo", '{"x":1}') + E, "normal text",
         (("foo", {"x": 1}),)),
    Case("deepseek_v3", "V3.1: parallel, text after", "some prefix text" + B + v31_call("foo", '{"x":1}')
         + v31_call("bar", '{"y":2}') + E + " some suffix text", "some prefix text some suffix text",
         (("foo", {"x": 1}), ("bar", {"y": 2}))),
    Case("deepseek_v3", "no call", "How can I help you today?", "How can I help you today?"),
    Case("deepseek_v3", "malformed: no call markers", B + "foo" + SEP + '{"x":1}' + E,
         B + "foo" + SEP + '{"x":1}' + E),
    Case("deepseek_v3", "malformed: V3 without a call begin",
         B + "function" + SEP + 'get_weather\n```json\n{"city": "Tokyo"}\n```' + E,
         B + "function" + SEP + 'get_weather\n```json\n{"city": "Tokyo"}\n```' + E),
    Case("deepseek_v3", "malformed: unknown name", B + v31_call("rm_rf", "{}") + E, B + v31_call("rm_rf", "{}") + E),
    Case("deepseek_v3", "malformed: arguments left open", B + v3_call("get_weather", '{"city": "Tokyo"') + E, "",
         (("get_weather", Cut('{"city": "Tokyo"')),)),
    Case("deepseek_v3", "cut before the call is known", "Let me look that up." + B + "get_weather",
         "Let me look that up." + B + "get_weather"),
    Case("deepseek_v3", "cut inside the arguments", B + CB + "function" + SEP + 'get_weather\n```json\n{"city": "To',
         "", (("get_weather", Cut('{"city": "To')),)),
]

# ---- pythonic --------------------------------------------------------------------------------------------
P_WEATHER = "get_weather(city='San Francisco', metric='celsius')"
P_USER = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
          "passed_test=True, aliases=['John', 'Johnny'])")
USER = {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, "role": None,
        "passed_test": True, "aliases": ["John", "Johnny"]}

PYTHONIC = [
    Case("pythonic", "single", f"[{P_WEATHER}]", "",
         (("get_weather", {"city": "San Francisco", "metric": "celsius"}),)),
    Case("pythonic", "parallel", f"[{P_WEATHER}, {P_USER}]", "",
         (("get_weather", {"city": "San Francisco", "metric": "celsius"}), ("register_user", USER))),
    Case("pythonic", "no arguments", "[get_current_time()]", "", (("get_current_time", {}),)),
    Case("pythonic", "escaped strings", "[send_message(text='Martha\\'s Vineyard', unit=\"\\u00b0C\\n\", "
         "tab='a\\tb', raw=r'C:\\dir', empty='', long='''x''')]", "",
         (("send_message", {"text": "Martha's Vineyard", "unit": "°C\n", "tab": "a\tb", "raw": "C:\\dir",
                            "empty": "", "long": "x"}),)),
    Case("pythonic", "unicode", "[send_message(text='Привет, мир! 🎉')]", "",
         (("send_message", {"text": "Привет, мир! 🎉"}),)),
    Case("pythonic", "numbers, tuples, JSON words, trailing commas", "[add(a=-1.5e3, b=(1, 2), c=true, d=null,), ]",
         "", (("add", {"a": -1500.0, "b": [1, 2], "c": True, "d": None}),)),
    Case("pythonic", "whitespace and text after", f"  [{P_WEATHER}]\n\nHope that helps.", "\n\nHope that helps.",
         (("get_weather", {"city": "San Francisco", "metric": "celsius"}),)),
    Case("pythonic", "no call", "Hello! How can I help?", "Hello! How can I help?"),
    Case("pythonic", "text before the call (the format has none: content)", f"Sure: [{P_WEATHER}]",
         f"Sure: [{P_WEATHER}]"),
    Case("pythonic", "malformed: unknown function", "[rm_rf(path='/')]", "[rm_rf(path='/')]"),
    Case("pythonic", "malformed: a list that is not calls", "[1, 2, 3]", "[1, 2, 3]"),
    Case("pythonic", "malformed: a good call, then an unknown one", f"[{P_WEATHER}, rm_rf()]", ", rm_rf()]",
         (("get_weather", {"city": "San Francisco", "metric": "celsius"}),)),
    Case("pythonic", "malformed: a value that is not a literal", "[get_weather(city='SF', metric=celsius)]", "",
         (("get_weather", Cut('{"city": "SF", "metric": ')),)),
    Case("pythonic", "malformed: a positional argument", "[get_weather('SF')]", "", (("get_weather", Cut("{")),)),
    Case("pythonic", "cut inside a string", "[get_weather(city='San Fra", "",
         (("get_weather", Cut('{"city": "San Fra')),)),
    Case("pythonic", "cut before the call is known", "[get_wea", "[get_wea"),
]

CASES: list[Case] = HERMES + LLAMA3 + MISTRAL + QWEN3_CODER + DEEPSEEK + PYTHONIC

# One call per family whose arguments are long enough to stream in several fragments.
LONG_TEXT = "A long argument, streamed as the model writes it. " * 8
LONG: dict[str, str] = {
    "hermes": f'<tool_call>\n{{"name": "send_message", "arguments": {{"text": "{LONG_TEXT}"}}}}\n</tool_call>',
    "llama3_json": f'{{"name": "send_message", "parameters": {{"text": "{LONG_TEXT}"}}}}',
    "mistral": f'[TOOL_CALLS]send_message[ARGS]{{"text": "{LONG_TEXT}"}}',
    "qwen3_coder": q_call("send_message", ("text", LONG_TEXT)),
    "deepseek_v3": B + v3_call("send_message", '{"text": "' + LONG_TEXT + '"}') + E,
    "pythonic": f"[send_message(text='{LONG_TEXT}')]",
}
FAMILIES = sorted(LONG)
