"""services/tokenizer/reasoning.py and the servicer with --reasoning-parser: when an output starts thinking, what
the engine is told, each sequence's text split into reasoning_content and the answer (tool calls read from the
answer alone), and refusals. In process: a scripted engine stream instead of an engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from common.errors import InvalidRequestError
from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, engine_pb2, generation_pb2
from services.tokenizer.chat import render_chat
from services.tokenizer.reasoning import Reasoning, plan_reasoning
from services.tokenizer.service import EngineInfo, GenerationServicer
from services.tokenizer.tools import ToolSettings

# DeepSeek-R1-0528's way: the template opens the block, the model writes the end tag.
R1_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
# Qwen3's: thinking off closes an empty block in the prompt.
QWEN3_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
OUTPUT = ('The user wants Paris 🌧️ weather.\nI will call the tool.\n</think>\n\nLet me check.'
          '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>')
WEATHER = generation_pb2.Tool(name="get_weather", parameters=json.dumps(
    {"type": "object", "properties": {"location": {"type": "string"}}}))
SCHEMA = common_pb2.GuidedDecoding(json_schema='{"type": "object"}')


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The default model's tokenizer with the thinking tags added as plain (not special) tokens."""
    base = Tokenizer.from_pretrained(default_model_path())
    backend = HFTokenizer.from_str(base.backend.to_str())
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return Tokenizer(backend, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                     chat_template=R1_TEMPLATE)


@pytest.fixture(scope="module")
def r1(tokenizer: Tokenizer) -> Reasoning:
    return Reasoning.load("deepseek_r1", tokenizer)


def chat_request(template: str | None = None, kwargs: dict[str, Any] | None = None,
                 **kw: Any) -> generation_pb2.GenerateRequest:
    """A chat request; ``template``: its own chat template (None: the tokenizer's, R1's)."""
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="Weather in Paris?")],
                               chat_template_kwargs=json.dumps(kwargs or {}))
    if template is not None:
        chat.chat_template = template
    return generation_pb2.GenerateRequest(chat=chat, **kw)


def prompt(tokenizer: Tokenizer, request: generation_pb2.GenerateRequest) -> list[int]:
    return tokenizer.encode(render_chat(tokenizer, request.chat), add_special_tokens=False)


# -- the plan ----------------------------------------------------------------------------------------------------
def test_the_tags_are_resolved_once_and_must_be_plain_tokens(tokenizer: Tokenizer, r1: Reasoning) -> None:
    assert (r1.start_token_id, r1.end_token_id) == (tokenizer.backend.token_to_id("<think>"),
                                                    tokenizer.backend.token_to_id("</think>"))
    with pytest.raises(ValueError, match="has no token '<think>'"):
        Reasoning.load("qwen3", Tokenizer.from_pretrained(default_model_path()))
    special = HFTokenizer.from_str(tokenizer.backend.to_str())
    special.add_special_tokens([AddedToken("</think>", special=True)])
    with pytest.raises(ValueError, match="marks '</think>' special"):
        Reasoning.load("qwen3", Tokenizer(special))
    with pytest.raises(ValueError, match="expected one of deepseek_r1, qwen3"):
        Reasoning.load("granite", tokenizer)


def test_the_engine_hears_of_the_thinking_only_when_a_constraint_or_budget_needs_it(
        tokenizer: Tokenizer, r1: Reasoning) -> None:
    request = chat_request()
    ids = prompt(tokenizer, request)
    plan = plan_reasoning(request, r1, ids, constrained=False)
    assert plan.thinking and plan.parser is r1.parser and plan.engine is None
    plan = plan_reasoning(request, r1, ids, constrained=True)
    assert plan.engine == engine_pb2.EngineReasoning(end_token_id=r1.end_token_id)
    request.thinking_token_budget = 0
    plan = plan_reasoning(request, r1, ids, constrained=False)
    assert plan.engine is not None and plan.engine.HasField("thinking_token_budget")
    assert (plan.engine.end_token_id, plan.engine.thinking_token_budget) == (r1.end_token_id, 0)


def test_thinking_turned_off_leaves_the_output_all_answer(tokenizer: Tokenizer) -> None:
    qwen3 = Reasoning.load("qwen3", tokenizer)
    off = chat_request(QWEN3_TEMPLATE, {"enable_thinking": False}, guided=SCHEMA, thinking_token_budget=5)
    plan = plan_reasoning(off, qwen3, prompt(tokenizer, off), constrained=True)
    assert not plan.thinking and plan.engine is None   # the template closed the block: nothing to budget
    assert plan.parser is not None and plan.parser.parse("a</think>b", plan.thinking).content == "a</think>b"
    # A template that ignores the switch: Qwen3's parser still reads it; R1's has none.
    on_template = chat_request(QWEN3_TEMPLATE + "<think>", {"enable_thinking": False})
    ids = prompt(tokenizer, on_template)
    assert not plan_reasoning(on_template, qwen3, ids, constrained=True).thinking
    assert plan_reasoning(on_template, Reasoning.load("deepseek_r1", tokenizer), ids, constrained=True).thinking


def test_refusals(tokenizer: Tokenizer, r1: Reasoning) -> None:
    text = generation_pb2.GenerateRequest(text="hi", thinking_token_budget=4)
    with pytest.raises(InvalidRequestError, match="needs chat input") as e:
        plan_reasoning(text, r1, [1, 2], constrained=False)
    assert e.value.field == "thinking_token_budget"
    with pytest.raises(InvalidRequestError, match="--reasoning-parser"):
        plan_reasoning(chat_request(thinking_token_budget=4), None, [1, 2], constrained=False)
    plain = plan_reasoning(generation_pb2.GenerateRequest(text="hi"), r1, [1, 2], constrained=True)
    assert plain.parser is None and plain.engine is None   # completions are not parsed (as vLLM)


# -- the servicer ------------------------------------------------------------------------------------------------
class ScriptedStream:
    """The servicer's engine stream: records each engine request, answers with ``script`` one token a message."""

    def __init__(self) -> None:
        self.script: list[int] = []
        self.requests: list[engine_pb2.EngineGenerateRequest] = []

    async def generate(self, request: engine_pb2.EngineGenerateRequest, **_: Any
                       ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        self.requests.append(request)
        for i, token in enumerate(self.script):
            last = i == len(self.script) - 1
            yield engine_pb2.EngineGenerateResponse(
                index=0, token_ids=[token], request_done=last,
                finish_reason=common_pb2.FINISH_REASON_EOS if last else common_pb2.FINISH_REASON_UNSPECIFIED)

    def close(self) -> None:
        pass


def serve(tokenizer: Tokenizer, reasoning: Reasoning, request: generation_pb2.GenerateRequest, script: list[int]
          ) -> tuple[list[generation_pb2.GenerateResponse], engine_pb2.EngineGenerateRequest]:
    async def run() -> tuple[list[generation_pb2.GenerateResponse], engine_pb2.EngineGenerateRequest]:
        channel = grpc.aio.insecure_channel("127.0.0.1:9")   # never used: the stream is scripted
        servicer = GenerationServicer(tokenizer, channel, served_model_name="m", reasoning=reasoning,
                                      tools=ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes"))
        servicer._info = EngineInfo("m", 4096, tokenizer.vocab_size, [tokenizer.eos_token_id or 0], None)
        stream = ScriptedStream()
        stream.script = script
        servicer.engine_stream = stream  # type: ignore[assignment]
        try:
            return [m async for m in servicer.generate(request, "r", timeout=None)], stream.requests[0]
        finally:
            servicer.close()
            await channel.close()

    return asyncio.run(run())


def test_a_chat_output_streams_its_thinking_then_the_answer_whose_tool_calls_are_parsed(
        tokenizer: Tokenizer, r1: Reasoning) -> None:
    script = tokenizer.encode(OUTPUT, add_special_tokens=False)
    assert r1.end_token_id in script
    request = chat_request()
    request.chat.tools.append(WEATHER)
    msgs, engine_request = serve(tokenizer, r1, request, script)
    assert not engine_request.HasField("reasoning")   # no constraint, no budget
    assert "".join(m.reasoning_content for m in msgs) == "The user wants Paris 🌧️ weather.\nI will call the tool.\n"
    assert "".join(m.text for m in msgs) == "\n\nLet me check."
    calls: dict[int, list[str]] = {}
    for call in (c for m in msgs for c in m.tool_calls):   # the first delta names it, later ones add arguments
        calls.setdefault(call.index, [call.name, ""])[1] += call.arguments
    assert calls == {0: ["get_weather", '{"location": "Paris"}']}
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    # Thinking first, every message one kind until the end tag's; none carries both but that one.
    kinds = [(bool(m.reasoning_content), bool(m.text or m.tool_calls)) for m in msgs]
    switch = next(i for i, m in enumerate(msgs) if m.token_ids and m.token_ids[-1] == r1.end_token_id)
    assert all(k == (True, False) for k in kinds[:switch] if any(k))
    assert all(k == (False, True) for k in kinds[switch + 1:] if any(k))
    assert [t for m in msgs for t in m.token_ids] == script


def test_a_guided_chat_tells_the_engine_where_the_thinking_ends(tokenizer: Tokenizer, r1: Reasoning) -> None:
    script = tokenizer.encode('hmm</think>{"a": 1}', add_special_tokens=False)
    msgs, engine_request = serve(tokenizer, r1, chat_request(guided=SCHEMA, thinking_token_budget=7), script)
    assert engine_request.guided == SCHEMA
    assert engine_request.reasoning == engine_pb2.EngineReasoning(end_token_id=r1.end_token_id,
                                                                  thinking_token_budget=7)
    assert ("".join(m.reasoning_content for m in msgs), "".join(m.text for m in msgs)) == ("hmm", '{"a": 1}')


def test_a_thinking_cut_short_keeps_what_was_held_back(tokenizer: Tokenizer, r1: Reasoning) -> None:
    script = tokenizer.encode("still thinking </", add_special_tokens=False)
    msgs, _ = serve(tokenizer, r1, chat_request(), script)
    assert "".join(m.reasoning_content for m in msgs) == "still thinking </"
    assert msgs[-1].reasoning_content.endswith("</") and "".join(m.text for m in msgs) == ""
