"""The request API of issue 22 end to end, through `sluice serve` and the official openai SDK: structured outputs
(validated with jsonschema and lark), tool calling on the default model and on a tiny random Qwen2 with a
Hermes-style template (rendering checked against transformers), beam search, best_of, echo and prompt logprobs
(checked against transformers' log-softmax over the prompt)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tests.engine.text.test_chat import QWEN25_TEMPLATE
from tests.procs import ServeStack

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# Small arithmetic expressions, bounded so that every sampled output can finish within max_tokens.
ARITHMETIC = r"""
start: expr
expr: term (OP term)~0..3
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[1-9][0-9]{0,2}/
"""




def _client(stack: ServeStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stack(traced_stack: ServeStack) -> ServeStack:
    """tests/e2e/conftest.py: float32, 16 sequences, 512 MiB of KV cache (shared with test_tracing.py)."""
    return traced_stack


@pytest.fixture(scope="module")
def model(stack: ServeStack) -> str:
    return _client(stack).models.list().data[0].id


# -- structured outputs ----------------------------------------------------------------------------------------

def test_json_schema_sampled_outputs_all_validate(stack: ServeStack, model: str) -> None:
    client = _client(stack)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(seed: int) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=fmt, temperature=1.0, seed=seed, max_tokens=300)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(20)))
    texts = [r.choices[0].message.content for r in responses]
    for r, text in zip(responses, texts):
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 10  # sampled, not one answer repeated
    info = stack.engine_idle()
    assert info.free_kv_blocks == info.total_kv_blocks


class City(BaseModel):
    name: str = Field(max_length=20)
    country: Literal["France", "Germany", "Italy", "Spain"]
    population: int = Field(ge=0, le=99_999_999)


def test_openai_sdk_parse_with_a_pydantic_model(stack: ServeStack, model: str) -> None:
    client = _client(stack)
    resp = client.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Give me a European city as JSON."}],
        response_format=City, temperature=0, max_tokens=200)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert City.model_validate_json(resp.choices[0].message.content or "") == parsed


def test_regex_choice_and_lark_grammar(stack: ServeStack, model: str) -> None:
    lark = pytest.importorskip("lark")
    client = _client(stack)
    prompt = "Write something:"
    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    for seed in range(4):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=1.0, seed=seed,
                                        extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
        assert out.choices[0].finish_reason == "stop"
    choices = ["red", "green", "blue", "dark purple"]
    out = client.completions.create(model=model, prompt="My favourite colour is", max_tokens=10, temperature=1.0,
                                    n=6, seed=3, extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in out.choices), [c.text for c in out.choices]
    parser = lark.Lark(ARITHMETIC)
    for seed in range(6):
        out = client.completions.create(model=model, prompt="An arithmetic expression:", max_tokens=64,
                                        temperature=1.0, seed=seed, extra_body={"guided_grammar": ARITHMETIC})
        assert out.choices[0].finish_reason == "stop", out.choices[0].text
        parser.parse(out.choices[0].text)  # raises on a text outside the grammar


def test_invalid_constraints_are_400_naming_the_field(stack: ServeStack, model: str) -> None:
    cases = [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "guided_json"),
        ({"guided_grammar": "start: ???"}, "guided_grammar"),
    ]
    for extra, name in cases:
        r = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                       json={"model": model, "prompt": "x", "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert name in (err["param"] or "") + err["message"]
    info = stack.engine_idle()
    assert info.free_kv_blocks == info.total_kv_blocks


def test_grammar_that_cannot_finish_ends_with_length(stack: ServeStack, model: str) -> None:
    out = _client(stack).completions.create(model=model, prompt="Digits:", max_tokens=5, temperature=0,
                                            extra_body={"guided_regex": "[0-9]{50}"})
    assert out.choices[0].finish_reason == "length"
    assert re.fullmatch("[0-9]+", out.choices[0].text)


# -- tool calling ------------------------------------------------------------------------------------------------

def _check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function"
    assert call.id
    assert call.function.name in SCHEMAS
    if name is not None:
        assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def _tool_round_trip(client: openai.OpenAI, model: str, *, max_tokens: int = 120, parallel: bool = True) -> None:
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        resp = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                              parallel_tool_calls=parallel, temperature=0, max_tokens=max_tokens)
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls", resp.model_dump_json()
        assert message.tool_calls
        for call in message.tool_calls:
            _check_call(call, "get_weather" if isinstance(choice, dict) else None)

        # The same request streamed: the SDK's stream helper reassembles the deltas into the same calls.
        with client.beta.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 parallel_tool_calls=parallel, temperature=0,
                                                 max_tokens=max_tokens) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        assert final.choices[0].finish_reason == "tool_calls"

        # Second turn: the call and its result in the history render and generate.
        call = message.tool_calls[0]
        history = [*ASK,
                   {"role": "assistant", "content": None,
                    "tool_calls": [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
        answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                                temperature=0, max_tokens=20)
        assert answer.choices[0].message.content
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert not answer.choices[0].message.tool_calls


def test_tool_calls_named_and_required_on_the_default_model(stack: ServeStack, model: str) -> None:
    _tool_round_trip(_client(stack), model)


def test_auto_tool_choice_without_a_parser_is_refused(stack: ServeStack, model: str) -> None:
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "tool" in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory, default_hf_tokenizer: Any) -> Path:
    """A tiny random Qwen2 checkpoint with the default model's vocabulary and Qwen2.5's tool template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = copy.deepcopy(default_hf_tokenizer)  # the session's one keeps its own template
    tokenizer.chat_template = QWEN25_TEMPLATE
    out = tmp_path_factory.mktemp("qwen2")
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen_stack(tmp_path_factory: pytest.TempPathFactory, qwen_dir: Path) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("qwen"), "--model", str(qwen_dir), "--dtype", "float32",
                   "--max-num-seqs", "8", "--kv-cache-memory", "256MiB", "--enable-auto-tool-choice",
                   "--tool-call-parser", "hermes",
                   # A random model would pad the JSON with whitespace until max_tokens: vLLM's switch turns it off.
                   "--structured-outputs-config", '{"backend": "llguidance", "disable_any_whitespace": true}')
    s.start()
    yield s
    s.stop()


def test_qwen2_hermes_template_renders_tools_as_transformers(qwen_stack: ServeStack, qwen_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    # The directory's tokenizer.json as it is (AutoTokenizer would pick Qwen2's tokenizer class from config.json
    # and pre-tokenize differently from the file the server reads).
    hf = PreTrainedTokenizerFast.from_pretrained(qwen_dir)
    model = _client(qwen_stack).models.list().data[0].id
    history = [*ASK,
               {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather",
                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    for messages in (ASK, history):
        ours = httpx.post(f"{qwen_stack.base_url}/tokenize", timeout=60,
                          json={"model": model, "messages": messages, "tools": TOOLS}).json()
        hf_messages = [dict(m) for m in messages]
        for m in hf_messages:  # transformers' templates take the arguments as a mapping
            for call in m.get("tool_calls", []):
                call["function"] = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
        expected = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert ours["tokens"] == hf(expected, add_special_tokens=False)["input_ids"]


def test_qwen2_tool_calls_round_trip(qwen_stack: ServeStack) -> None:
    client = _client(qwen_stack)
    # A random model spells strings with escapes (six tokens a character) and would call tools without end.
    _tool_round_trip(client, client.models.list().data[0].id, max_tokens=400, parallel=False)
    info = qwen_stack.engine_idle()
    assert info.free_kv_blocks == info.total_kv_blocks


# -- beam search, best_of, echo, prompt logprobs --------------------------------------------------------------------

def test_beam_search_and_best_of(stack: ServeStack, model: str) -> None:
    client = _client(stack)
    prompt = "The three primary colours are"
    beams = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=8, temperature=0,
                                      extra_body={"use_beam_search": True, "length_penalty": 1.0})
    again = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=8, temperature=0,
                                      extra_body={"use_beam_search": True, "length_penalty": 1.0})
    texts = [c.text for c in beams.choices]
    assert len(texts) == 3 and len(set(texts)) == 3        # three different beams
    assert texts == [c.text for c in again.choices]       # deterministic
    greedy = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    best = client.completions.create(model=model, prompt=prompt, n=1, best_of=4, max_tokens=8, temperature=1.0,
                                     seed=1, logprobs=0)
    assert len(best.choices) == 1 and best.choices[0].text
    assert greedy  # the greedy text exists to compare against in the log when a beam assertion fails
    info = stack.engine_idle()
    assert info.free_kv_blocks == info.total_kv_blocks


def test_echo_and_prompt_logprobs_match_transformers(stack: ServeStack, model: str, default_hf_tokenizer: Any,
                                                     default_hf_model: Any) -> None:
    tokenizer, hf = default_hf_tokenizer, default_hf_model
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True,
                         "logprobs": 1}).json()
    choice = r["choices"][0]
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"][:len(ids)]) == tokenizer.decode(ids)
    assert lp["token_logprobs"][0] is None
    ours = torch.tensor(lp["token_logprobs"][1:len(ids)])
    assert torch.allclose(ours, expected, atol=1e-4), (ours - expected).abs().max()

    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120,
                   json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                         "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for pos, entry in enumerate(plp[1:], start=1):
        got = entry[str(ids[pos])]["logprob"]
        assert abs(got - float(expected[pos - 1])) < 1e-4


# -- request keys ------------------------------------------------------------------------------------------------
def test_a_client_request_id_is_not_the_engines_key(stack: ServeStack, model: str) -> None:
    """X-Request-Id is the client's, for logs and echo: two requests in flight may share one, and an id is
    reusable at once after a stop string ended its request (the engine's abort of that request, still on its
    way, must not reach the next one)."""
    client = _client(stack)
    body = dict(model=model, prompt="Count: one, two, three,", max_tokens=24, temperature=0.0)
    with ThreadPoolExecutor(2) as pool:
        shared = list(pool.map(lambda _: client.completions.with_raw_response.create(
            **body, extra_headers={"X-Request-Id": "same-id"}), range(2)))
    assert [r.headers["x-request-id"] for r in shared] == ["same-id", "same-id"]
    texts = [r.parse().choices[0].text for r in shared]
    assert texts[0] == texts[1] and len(texts[0]) > 4   # both ran to the end, greedily alike
    stop = texts[0][2:5]   # a string the greedy output reaches early: the tokenizer service stops it
    for _ in range(30):
        r = client.completions.with_raw_response.create(**body, stop=[stop], extra_headers={"X-Request-Id": "again"})
        choice = r.parse().choices[0]
        assert choice.finish_reason == "stop" and choice.text == texts[0][:texts[0].index(stop)], choice
