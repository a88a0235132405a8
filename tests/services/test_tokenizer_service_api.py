"""The tokenizer service as a real process in front of a scripted fake engine: tool calling (auto with the
hermes parser, required, a named function), echo, and the new fields going to the engine and coming back."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.procs import ROOT, free_port, tokenizer_process
from tests.services.test_tokenizer_service import ScriptedEngine

# What Qwen2.5-7B-Instruct answered to "Weather in Paris and the time in Tokyo?" with these two tools.
HERMES_TEXT = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>')
WEATHER = generation_pb2.Tool(name="get_weather", parameters=json.dumps(
    {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}))
TIME = generation_pb2.Tool(name="get_time", parameters=json.dumps(
    {"type": "object", "properties": {"timezone": {"type": "string"}}}))
PROMPT_LOGPROBS = [common_pb2.PromptTokenLogprob(token_id=28, top_logprobs=[]),
                   common_pb2.PromptTokenLogprob(token_id=29, logprob=-1.5, top_logprobs=[
                       common_pb2.PromptTopLogprob(token_id=30, logprob=-0.5)])]


class RichEngine(ScriptedEngine):
    """The scripted engine, plus prompt log probabilities on each sequence's first message with tokens (when
    asked) and a cumulative log probability on its last, as the engine sends them."""

    def Generate(self, request, context):  # noqa: N802
        first: set[int] = set()
        for msg in super().Generate(request, context):
            if request.HasField("prompt_logprobs") and msg.token_ids and msg.index not in first:
                first.add(msg.index)
                msg.prompt_logprobs.extend(PROMPT_LOGPROBS)
            if msg.finish_reason:
                msg.cumulative_logprob = -2.25
            yield msg


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RichEngine, str]]:
    engine = RichEngine([])
    server = grpc.server(futures.ThreadPoolExecutor(8))
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        with tokenizer_process(tmp_path_factory.mktemp("tools"), f"127.0.0.1:{port}", "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes") as addr:
            yield engine, addr
    finally:
        server.stop(0)


def generate(addr: str, **kw: object) -> list[generation_pb2.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
    return list(stub.Generate(generation_pb2.GenerateRequest(**kw), timeout=30))


def chat(**kw: object) -> generation_pb2.Chat:
    return generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="Paris? Tokyo?")],
                               tools=[WEATHER, TIME], **kw)


def calls(msgs: list[generation_pb2.GenerateResponse]) -> list[tuple[str, str]]:
    """(name, arguments) per call, from the deltas: the first of a call has its id and name."""
    out: list[list[str]] = []
    for m in msgs:
        for d in m.tool_calls:
            if d.index == len(out):
                assert d.id.startswith("call_") and d.name
                out.append([d.name, d.arguments])
            else:
                assert d.index == len(out) - 1 and not d.id and not d.name
                out[-1][1] += d.arguments
    return [(name, args) for name, args in out]


def test_auto_with_the_hermes_parser_streams_content_then_calls(fake: tuple[RichEngine, str],
                                                               tokenizer: Tokenizer) -> None:
    engine, addr = fake
    engine.script = tokenizer.encode(HERMES_TEXT, add_special_tokens=False)
    msgs = generate(addr, chat=chat())
    assert not engine.requests[-1].HasField("guided")  # auto constrains nothing
    assert "".join(m.text for m in msgs) == "I will look both up.\n"
    assert calls(msgs) == [("get_weather", '{"location": "Paris"}'), ("get_time", '{"timezone": "Asia/Tokyo"}')]
    assert [m.finish_reason for m in msgs if m.finish_reason] == [common_pb2.FINISH_REASON_TOOL_CALLS]
    # The content came before the first call began; each call's arguments came in fragments as the tokens did.
    first_call = next(i for i, m in enumerate(msgs) if m.tool_calls)
    assert "".join(m.text for m in msgs[:first_call]) == "I will look both up.\n"
    assert sum(len(m.tool_calls) for m in msgs) > 2
    assert [t for m in msgs for t in m.token_ids] == engine.script


def test_tool_choice_none_returns_the_text_as_is(fake: tuple[RichEngine, str], tokenizer: Tokenizer) -> None:
    engine, addr = fake
    engine.script = tokenizer.encode(HERMES_TEXT, add_special_tokens=False)
    msgs = generate(addr, chat=chat(), tool_choice=generation_pb2.ToolChoice(none=True))
    assert "".join(m.text for m in msgs) == HERMES_TEXT and calls(msgs) == []
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # the scripted engine's


def test_required_sends_the_array_schema_and_reads_the_calls_back(fake: tuple[RichEngine, str],
                                                                  tokenizer: Tokenizer) -> None:
    engine, addr = fake
    output = '[{"name": "get_time", "parameters": {"timezone": "UTC"}}]'
    engine.script = tokenizer.encode(output, add_special_tokens=False)
    msgs = generate(addr, chat=chat(), tool_choice=generation_pb2.ToolChoice(required=True),
                    parallel_tool_calls=False)
    schema = json.loads(engine.requests[-1].guided.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert calls(msgs) == [("get_time", '{"timezone": "UTC"}')] and "".join(m.text for m in msgs) == ""


def test_a_named_function_sends_its_parameters_schema_and_streams_its_arguments(fake: tuple[RichEngine, str],
                                                                               tokenizer: Tokenizer) -> None:
    engine, addr = fake
    output = '{"location": "Paris"}'
    engine.script = tokenizer.encode(output, add_special_tokens=False)
    msgs = generate(addr, chat=chat(), tool_choice=generation_pb2.ToolChoice(function_name="get_weather"))
    assert engine.requests[-1].guided.json_schema == WEATHER.parameters
    assert calls(msgs) == [("get_weather", output)]
    assert sum(len(m.tool_calls) for m in msgs) > 1  # fragments as the tokens came
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # cut short stays what it was


def test_without_a_parser_auto_is_refused_and_the_services_chat_template_renders(tmp_path: Path,
                                                                                  tokenizer: Tokenizer) -> None:
    engine = ScriptedEngine([100])
    server = grpc.server(futures.ThreadPoolExecutor(4))
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        template = "{{ 'T:' + messages[0].content }}{% if tools %}|{{ tools[0].function.name }}{% endif %}"
        with tokenizer_process(tmp_path, f"127.0.0.1:{port}", "--chat-template", template) as addr:
            stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
            rendered = stub.ApplyChatTemplate(generation_pb2.ApplyChatTemplateRequest(chat=chat()))
            assert rendered.text == "T:Paris? Tokyo?|get_weather"
            tokenized = stub.Tokenize(generation_pb2.TokenizeRequest(chat=chat()))
            assert list(tokenized.token_ids) == tokenizer.encode(rendered.text, add_special_tokens=False)
            with pytest.raises(grpc.RpcError) as err:
                generate(addr, chat=chat())
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == ('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                           '--tool-call-parser to be set')
            assert engine.requests == []
    finally:
        server.stop(0)


@pytest.mark.parametrize("kw, field", [
    ({"chat": chat(), "tool_choice": generation_pb2.ToolChoice(function_name="nope")}, "tool_choice"),
    ({"text": "hi", "tool_choice": generation_pb2.ToolChoice(required=True)}, "tool_choice"),
    ({"chat": chat(), "response": generation_pb2.ResponseOptions(echo=True)}, "echo"),
    ({"text": "hi", "n": 2, "best_of": 1}, "best_of"),
])
def test_refusals_are_invalid_argument_naming_the_field(fake: tuple[RichEngine, str], kw: dict[str, object],
                                                        field: str) -> None:
    engine, addr = fake
    before = len(engine.requests)
    with pytest.raises(grpc.RpcError) as err:
        generate(addr, **kw)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(f"{field}: ")
    assert len(engine.requests) == before


def test_echo_starts_each_sequence_with_the_prompt_and_carries_prompt_logprobs_with_text(
        fake: tuple[RichEngine, str], tokenizer: Tokenizer) -> None:
    engine, addr = fake
    engine.script = tokenizer.encode(" and more", add_special_tokens=False)
    msgs = generate(addr, text="Once upon", n=2, best_of=3,
                    response=generation_pb2.ResponseOptions(echo=True, logprobs=True, top_logprobs=2))
    sent = engine.requests[-1]
    assert sent.prompt_logprobs == 2 and sent.best_of == 3 and sent.n == 2
    for index in (0, 1):
        mine = [m for m in msgs if m.index == index]
        assert mine[0].text.startswith("Once upon")
        assert "".join(m.text for m in mine) == "Once upon and more"
        assert [(p.token_id, p.text, p.text_bytes, p.HasField("logprob")) for p in mine[0].prompt_logprobs] == [
            (28, tokenizer.decode([28]), tokenizer.token_to_bytes(28), False),
            (29, tokenizer.decode([29]), tokenizer.token_to_bytes(29), True)]
        assert mine[0].prompt_logprobs[1].top_logprobs[0].text == tokenizer.decode([30])
        assert all(not m.prompt_logprobs for m in mine[1:])
        assert mine[-1].cumulative_logprob == -2.25
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    msgs = generate(addr, token_ids=common_pb2.TokenIds(ids=ids), response=generation_pb2.ResponseOptions(echo=True))
    assert "".join(m.text for m in msgs) == "Hello world and more"
    assert not engine.requests[-1].HasField("prompt_logprobs")  # echo without logprobs asks for none


def test_node_client_sends_a_guided_choice_and_tools(fake: tuple[RichEngine, str], tokenizer: Tokenizer) -> None:
    """The public proto's new oneofs and messages as a Node.js client (proto files only) writes them."""
    engine, addr = fake
    node = shutil.which("node")
    assert node, "node is required (make test installs the client's packages)"
    engine.script = tokenizer.encode("yes", add_special_tokens=False)
    body = {"text": "Is it?", "guided": {"choice": {"choices": ["yes", "no"]}}, "best_of": 2,
            "beam_search": {"beam_width": 2, "early_stopping": "BEAM_STOPPING_EARLY"}}
    result = _node(node, addr, body)
    assert result["text"] == "yes" and result.get("error") is None
    sent = engine.requests[-1]
    assert sent.guided == common_pb2.GuidedDecoding(choice=common_pb2.Choices(choices=["yes", "no"]))
    assert sent.best_of == 2 and sent.beam_search == common_pb2.BeamSearch(
        beam_width=2, early_stopping=common_pb2.BEAM_STOPPING_EARLY)
    engine.script = tokenizer.encode(HERMES_TEXT, add_special_tokens=False)
    body = {"chat": {"messages": [{"role": "user", "content": "Paris? Tokyo?"}],
                     "tools": [{"name": t.name, "parameters": t.parameters} for t in (WEATHER, TIME)]}}
    result = _node(node, addr, body)
    assert result["text"] == "I will look both up.\n" and result["finish_reason"] == "FINISH_REASON_TOOL_CALLS"
    assert [(c["name"], c["arguments"]) for c in result["tool_calls"]] == [
        ("get_weather", '{"location": "Paris"}'), ("get_time", '{"timezone": "Asia/Tokyo"}')]
    body["tool_choice"] = {"function_name": "get_time"}
    engine.script = tokenizer.encode('{"timezone": "UTC"}', add_special_tokens=False)
    result = _node(node, addr, body)
    assert engine.requests[-1].guided.json_schema == TIME.parameters
    assert [(c["name"], c["arguments"]) for c in result["tool_calls"]] == [("get_time", '{"timezone": "UTC"}')]


def _node(node: str, addr: str, body: dict[str, object]) -> dict[str, object]:
    out = subprocess.run([node, str(ROOT / "tests/node/generate.js"), addr, json.dumps(body)],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]
