"""Every request field vLLM and OpenAI define for the generation routes is accounted for: the route's model
declares it (it works) or gateway/request_fields.py refuses it by name — exactly one of the two. A field
added to a list below (or to the installed ``openai`` SDK's request types) without a handler fails
``test_every_field_is_handled_or_refused``. Then the fields handled since: what each does to the output."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import BaseModel

from engine.entrypoints.grpc_wire import sampling_params_from_pb
from gateway import request_fields
from gateway.backend import Delta, FinishReason, Usage
from gateway.convert import generate_request_to_pb
from gateway.errors import ApiError
from gateway.models import ChatCompletionRequest, CompletionRequest, StreamOptions
from gateway.request_fields import CHAT_REFUSED, COMPLETION_REFUSED, Refusal, declared
from gateway.responses import ResponseBuilder
from gateway.schemas import parse_chat, parse_completion
from proto.sluice.v1 import engine_pb2
from tests.gateway.conftest import Gateway
from tests.gateway.test_app import sse_data

# vLLM's request models, field by field, from vllm/entrypoints/openai/protocol.py at commit
# 0052bed36509c7a5a2d8e48265334e40cf2f5a0e (ChatCompletionRequest, CompletionRequest, StreamOptions).
VLLM_CHAT = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "include_reasoning", "parallel_tool_calls",
    "user", "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
)
VLLM_COMPLETION = (
    "model", "prompt", "prompt_embeds", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs", "add_special_tokens", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "cache_salt", "kv_transfer_params", "vllm_xargs",
)
VLLM_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _keys(typed_dict: Any) -> tuple[str, ...]:
    return tuple(sorted(typed_dict.__required_keys__ | typed_dict.__optional_keys__))


# OpenAI's, read from the installed SDK's request types.
OPENAI_CHAT = _keys(chat_create_params.CompletionCreateParamsStreaming)
OPENAI_COMPLETION = _keys(completion_create_params.CompletionCreateParamsStreaming)
OPENAI_STREAM_OPTIONS = _keys(ChatCompletionStreamOptionsParam)

ROUTES: dict[str, tuple[type[BaseModel], dict[str, Refusal], tuple[str, ...]]] = {
    "chat": (ChatCompletionRequest, CHAT_REFUSED, tuple(dict.fromkeys(VLLM_CHAT + OPENAI_CHAT))),
    "completions": (CompletionRequest, COMPLETION_REFUSED, tuple(dict.fromkeys(VLLM_COMPLETION + OPENAI_COMPLETION))),
    "stream_options": (StreamOptions, {}, tuple(dict.fromkeys(VLLM_STREAM_OPTIONS + OPENAI_STREAM_OPTIONS))),
}
WALK = [(route, name) for route, (_, _, names) in ROUTES.items() for name in names]
MESSAGES = [{"role": "user", "content": "hi"}]


def accounted(name: str, model: type[BaseModel], refused: dict[str, Refusal]) -> bool:
    """Handled (the model declares it) or refused by name: exactly one."""
    return (name in declared(model)) != (name in refused)


@pytest.mark.parametrize(("route", "name"), WALK, ids=[f"{r}-{n}" for r, n in WALK])
def test_every_field_is_handled_or_refused(route: str, name: str) -> None:
    model, refused, _ = ROUTES[route]
    assert accounted(name, model, refused), f"{route}: `{name}` is neither handled nor refused (or both)"


def test_a_field_added_without_a_handler_fails_the_walk() -> None:
    for model, refused, _ in ROUTES.values():
        assert not accounted("a_field_vllm_adds_next", model, refused)
    # And one both declared and refused is caught too.
    assert not accounted("n", CompletionRequest, {"n": Refusal("`n` ...")})


def _parse(route: str, fields: dict[str, Any]) -> Any:
    if route == "chat":
        return parse_chat({"messages": MESSAGES, **fields}, 4)
    return parse_completion({"prompt": "hi", **fields}, 4)


REFUSALS = [(route, name) for route in ("chat", "completions") for name in ROUTES[route][1]]


@pytest.mark.parametrize(("route", "name"), REFUSALS, ids=[f"{r}-{n}" for r, n in REFUSALS])
def test_a_refused_field_is_a_400_naming_it(route: str, name: str) -> None:
    with pytest.raises(ApiError) as e:
        _parse(route, {name: "x"})
    assert e.value.status == 400 and e.value.param == name and f"`{name}`" in e.value.message
    for allowed in ROUTES[route][1][name].allowed:  # the values that change nothing pass
        _parse(route, {name: allowed})
    _parse(route, {name: None})  # null reads as absent


def test_the_refusals_of_the_issue_and_their_no_op_values() -> None:
    assert "prompt_embeds" in CHAT_REFUSED and "prompt_embeds" in COMPLETION_REFUSED
    with pytest.raises(ApiError) as e:
        _parse("completions", {"prompt_embeds": "abc"})
    assert e.value.param == "prompt_embeds"
    with pytest.raises(ApiError) as e:
        _parse("chat", {"spaces_between_special_tokens": False})
    assert e.value.param == "spaces_between_special_tokens"
    _parse("chat", {"spaces_between_special_tokens": True})
    with pytest.raises(ApiError) as e:  # 1 is not true
        _parse("completions", {"spaces_between_special_tokens": 1})
    assert e.value.param == "spaces_between_special_tokens"


def test_unknown_names_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_fields, "_logged_unknown", set())
    with caplog.at_level(logging.WARNING, logger="gateway.request_fields"):
        plain = _parse("chat", {})
        first = _parse("chat", {"x_custom": 1, "another": [2]})
        _parse("chat", {"x_custom": 3})
        _parse("completions", {"x_custom": 3, "include_reasoning": False})  # a chat field, unknown here
    assert first.params == plain.params and first.prompts == plain.prompts
    logged = [r.getMessage() for r in caplog.records]
    assert sorted(logged) == sorted(f"request field {n!r} is not a known field: ignored"
                                    for n in ("x_custom", "another", "include_reasoning"))


def test_the_unknown_names_logged_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[str] = set()
    monkeypatch.setattr(request_fields, "_logged_unknown", seen)
    _parse("chat", {f"made_up_{i}": i for i in range(request_fields._MAX_LOGGED + 10)})
    assert len(seen) == request_fields._MAX_LOGGED


# -- include_reasoning -------------------------------------------------------------------------------------------


def _reasoning_run(include_reasoning: bool) -> tuple[dict[str, Any], list[Any]]:
    b = ResponseBuilder(is_chat=True, request_id="r", created=1, model="m", num_choices=1, logprobs=False,
                        include_reasoning=include_reasoning)
    deltas = [Delta(0, reasoning_content="Two and two."), Delta(0, text="4", finish_reason=FinishReason.EOS)]
    chunks = [(b.add(0, d), b.delta_chunk(0, d, 0))[1] for d in deltas]
    return b.full(Usage(3, 2)), chunks


def test_include_reasoning_false_leaves_the_thinking_out() -> None:
    assert _parse("chat", {"include_reasoning": False}).include_reasoning is False
    assert _parse("chat", {}).include_reasoning is True
    body, chunks = _reasoning_run(True)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
    assert [c["choices"][0]["delta"] for c in chunks] == [{"reasoning_content": "Two and two."}, {"content": "4"}]
    body, chunks = _reasoning_run(False)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "4"}
    assert chunks[0] is None and chunks[1]["choices"][0]["delta"] == {"content": "4"}


# -- reasoning_effort --------------------------------------------------------------------------------------------


def test_reasoning_effort_reaches_the_chat_template() -> None:
    req = _parse("chat", {"reasoning_effort": "low"})
    assert json.loads(req.prompts[0].chat_template_kwargs) == {"reasoning_effort": "low"}
    req = _parse("chat", {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high", "a": 1}})
    assert json.loads(req.prompts[0].chat_template_kwargs) == {"reasoning_effort": "high", "a": 1}
    assert _parse("chat", {}).prompts[0].chat_template_kwargs == ""


# -- stream_options.continuous_usage_stats -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(gateway: Gateway, path: str) -> None:
    base: dict[str, Any] = {"prompt": "hello there"} if path == "/v1/completions" else {"messages": MESSAGES}
    usages = {}
    for continuous in (False, True):
        r = await gateway.client.post(path, json={
            **base, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}})
        assert r.status_code == 200, r.text
        events = [json.loads(d) for d in sse_data(r.text) if d != "[DONE]"]
        usages[continuous] = [(bool(e["choices"]), e.get("usage")) for e in events]
    prompt = 2 if path == "/v1/completions" else 4  # the fake's count: words, plus 3 per chat turn
    final = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3,
             "prompt_tokens_details": {"cached_tokens": 1}}
    role = [(True, None)] if path == "/v1/chat/completions" else []  # the role chunk precedes any usage
    assert usages[False] == [*role, (True, None), (True, None), (True, None), (False, final)]
    assert usages[True] == [*role, *[(True, {**final, "completion_tokens": k, "total_tokens": prompt + k})
                                     for k in (1, 2, 3)], (False, final)]
    # Without include_usage it does nothing, as in vLLM.
    r = await gateway.client.post(path, json={**base, "stream": True,
                                              "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in json.loads(d) or json.loads(d)["usage"] is None
               for d in sse_data(r.text) if d != "[DONE]")


def test_include_obfuscation_can_only_be_false() -> None:
    _parse("chat", {"stream": True, "stream_options": {"include_obfuscation": False}})
    with pytest.raises(ApiError) as e:
        _parse("chat", {"stream": True, "stream_options": {"include_obfuscation": True}})
    assert e.value.param == "stream_options.include_obfuscation"


# -- truncate_prompt_tokens, add_special_tokens: to the tokenizer service (tests/services/test_prompt.py) ----------


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_prompt_options_reach_the_generate_request(route: str) -> None:
    req = _parse(route, {"truncate_prompt_tokens": 5, "add_special_tokens": route == "chat"})
    pb = generate_request_to_pb(req.prompts[0], req.params, "r")
    assert (pb.truncate_prompt_tokens, pb.add_special_tokens) == (5, route == "chat")
    unset = _parse(route, {})
    pb = generate_request_to_pb(unset.prompts[0], unset.params, "r")
    assert not pb.HasField("truncate_prompt_tokens") and not pb.HasField("add_special_tokens")
    for bad in (0, -1, True, "5"):
        with pytest.raises(ApiError) as e:
            _parse(route, {"truncate_prompt_tokens": bad})
        assert e.value.param == "truncate_prompt_tokens"


# -- allowed_token_ids: through the wire to the engine's SamplingParams (the masking: tests/engine) ---------------


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_allowed_token_ids_reach_the_engine(route: str) -> None:
    req = _parse(route, {"allowed_token_ids": [7, 40]})
    pb = generate_request_to_pb(req.prompts[0], req.params, "r")
    engine_req = engine_pb2.EngineGenerateRequest(request_id="r", sampling=pb.sampling)  # as the tokenizer copies it
    assert sampling_params_from_pb(engine_req).allowed_token_ids == [7, 40]
    unset = _parse(route, {})
    pb = generate_request_to_pb(unset.prompts[0], unset.params, "r")
    assert sampling_params_from_pb(engine_pb2.EngineGenerateRequest(sampling=pb.sampling)).allowed_token_ids is None
    for bad in ([], [-1], [1.5], "7"):
        with pytest.raises(ApiError) as e:
            _parse(route, {"allowed_token_ids": bad})
        assert (e.value.param or "").startswith("allowed_token_ids")


# -- bad_words: tokenized by the tokenizer service, banned by the engine's sampler (tests/engine/worker) ---------


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_bad_words_reach_the_engine_as_token_sequences(route: str) -> None:
    from engine.config import default_model_path
    from engine.text import Tokenizer
    from services.tokenizer.engine_request import bad_words_to_pb, check_options, engine_options

    assert "bad_words" not in CHAT_REFUSED and "bad_words" not in COMPLETION_REFUSED
    req = _parse(route, {"bad_words": ["Paris", " France"]})
    pb = generate_request_to_pb(req.prompts[0], req.params, "r")
    assert list(pb.bad_words) == ["Paris", " France"]
    check_options(pb)
    tokenizer = Tokenizer.from_pretrained(default_model_path())
    engine_req = engine_options(pb, "k", 1, None)
    engine_req.bad_words_token_ids.extend(bad_words_to_pb(list(pb.bad_words), tokenizer))
    sequences = sampling_params_from_pb(engine_req).bad_words_token_ids
    assert sequences is not None
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert sequences[0] == encode("Paris") and encode(" Paris") in sequences and encode("France") in sequences
    unset = _parse(route, {})
    assert not generate_request_to_pb(unset.prompts[0], unset.params, "r").bad_words
    assert sampling_params_from_pb(engine_options(
        generate_request_to_pb(unset.prompts[0], unset.params, "r"), "k", 1, None)).bad_words_token_ids is None
    for bad in ("Paris", [1], ["x"] * 129):
        with pytest.raises(ApiError) as e:
            _parse(route, {"bad_words": bad})
        assert (e.value.param or "").startswith("bad_words")
