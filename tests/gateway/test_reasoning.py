"""A reasoning model's thinking through the gateway: ``reasoning_content`` in chat messages and stream deltas
(the response models' shapes), and vLLM's ``thinking_token_budget`` on its way to the backend."""

from __future__ import annotations

import pytest

from gateway.backend import Delta, FinishReason, Usage
from gateway.convert import delta_from_pb, generate_request_to_pb
from gateway.errors import ApiError
from gateway.response_models import ChatCompletion, ChatCompletionChunk
from gateway.responses import ResponseBuilder
from gateway.schemas import parse_chat, parse_completion
from proto.sluice.v1 import common_pb2, generation_pb2

MESSAGES = [{"role": "user", "content": "hi"}]


def builder() -> ResponseBuilder:
    return ResponseBuilder(is_chat=True, request_id="r", created=1, model="m", num_choices=1, logprobs=False)


def test_the_message_carries_the_thinking_apart_from_the_answer() -> None:
    b = builder()
    deltas = [Delta(0, reasoning_content="Two and "), Delta(0, reasoning_content="two.", text=""),
              Delta(0, text='{"sum": 4}', finish_reason=FinishReason.EOS)]
    chunks = [(b.add(0, d), b.delta_chunk(0, d, 0))[1] for d in deltas]
    body = b.full(Usage(3, 5))
    ChatCompletion.model_validate(body)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"sum": 4}',  # type: ignore[index]
                                             "reasoning_content": "Two and two."}
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert [c["choices"][0]["delta"] for c in chunks if c] == [  # type: ignore[index]
        {"reasoning_content": "Two and "}, {"reasoning_content": "two."}, {"content": '{"sum": 4}'}]


def test_a_thinking_cut_short_has_null_content_and_no_thinking_no_field() -> None:
    b = builder()
    b.add(0, Delta(0, reasoning_content="Still", finish_reason=FinishReason.LENGTH))
    assert b.full(Usage())["choices"][0]["message"] == {  # type: ignore[index]
        "role": "assistant", "content": None, "reasoning_content": "Still"}
    b = builder()
    b.add(0, Delta(0, text="plain", finish_reason=FinishReason.EOS))
    assert b.full(Usage())["choices"][0]["message"] == {"role": "assistant", "content": "plain"}  # type: ignore[index]


def test_thinking_token_budget_reaches_the_backend_from_chat_only() -> None:
    req = parse_chat({"messages": MESSAGES, "thinking_token_budget": 64}, max_n=4)
    assert req.params.thinking_token_budget == 64
    pb = generate_request_to_pb(req.prompts[0], req.params, "r")
    assert pb.HasField("thinking_token_budget") and pb.thinking_token_budget == 64
    unset = parse_chat({"messages": MESSAGES}, max_n=4)
    assert not generate_request_to_pb(unset.prompts[0], unset.params, "r").HasField("thinking_token_budget")
    for parse, body in ((parse_completion, {"prompt": "hi", "thinking_token_budget": 8}),
                        (parse_chat, {"messages": MESSAGES, "thinking_token_budget": -1})):
        with pytest.raises(ApiError) as e:
            parse(body, 4)
        assert e.value.status == 400 and e.value.param == "thinking_token_budget"


def test_the_backend_delta_keeps_the_thinking() -> None:
    msg = generation_pb2.GenerateResponse(index=0, text="a", reasoning_content="b",
                                          finish_reason=common_pb2.FINISH_REASON_EOS)
    assert delta_from_pb(msg).reasoning_content == "b" and delta_from_pb(msg).text == "a"
