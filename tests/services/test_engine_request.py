"""services/tokenizer/engine_request.py: the new request fields checked and carried to the engine as they are."""

from __future__ import annotations

import grpc
import pytest

from common.errors import InvalidRequestError
from common.grpc_errors import status_for
from proto.sluice.v1 import common_pb2, engine_pb2, generation_pb2
from services.tokenizer.engine_request import MAX_SEQUENCES, check_options, engine_options


def test_guided_best_of_beam_search_and_prompt_logprobs_reach_the_engine() -> None:
    beam = common_pb2.BeamSearch(beam_width=4, length_penalty=0.5, early_stopping=common_pb2.BEAM_STOPPING_NEVER)
    request = generation_pb2.GenerateRequest(
        text="hi", n=2, best_of=3, beam_search=beam, guided=common_pb2.GuidedDecoding(regex="[ab]+"),
        response=generation_pb2.ResponseOptions(prompt_logprobs=0))
    check_options(request)
    req = engine_options(request, "r1", 2, None)
    assert req == engine_pb2.EngineGenerateRequest(
        request_id="r1", n=2, best_of=3, beam_search=beam, guided=common_pb2.GuidedDecoding(regex="[ab]+"),
        prompt_logprobs=0, sampling=common_pb2.SamplingParameters(), stopping=engine_pb2.EngineStoppingCriteria())
    assert req.HasField("prompt_logprobs")  # 0 alternatives is still asking for the prompt's logprobs


def test_without_the_new_fields_the_engine_request_has_none_of_them() -> None:
    req = engine_options(generation_pb2.GenerateRequest(text="hi"), "r", 1, None)
    assert not req.HasField("guided") and not req.HasField("beam_search") and not req.HasField("prompt_logprobs")
    assert req.best_of == 0


def test_tool_choices_guided_replaces_none() -> None:
    forced = common_pb2.GuidedDecoding(json_schema='{"type": "object"}')
    assert engine_options(generation_pb2.GenerateRequest(text="hi"), "r", 1, forced).guided == forced


@pytest.mark.parametrize("response, asked", [
    (generation_pb2.ResponseOptions(echo=True, logprobs=True, top_logprobs=3), 3),
    (generation_pb2.ResponseOptions(echo=True, logprobs=True, top_logprobs=1, prompt_logprobs=5), 5),
    (generation_pb2.ResponseOptions(echo=True), None),
    (generation_pb2.ResponseOptions(logprobs=True, top_logprobs=2), None),
])
def test_echo_with_logprobs_asks_for_the_prompts(response: generation_pb2.ResponseOptions, asked: int | None) -> None:
    req = engine_options(generation_pb2.GenerateRequest(text="hi", response=response), "r", 1, None)
    assert (req.prompt_logprobs if req.HasField("prompt_logprobs") else None) == asked


@pytest.mark.parametrize("request_, field, fragment", [
    (generation_pb2.GenerateRequest(text="hi", n=3, best_of=2), "best_of", "at least n (3), got 2"),
    (generation_pb2.GenerateRequest(text="hi", n=2, beam_search=common_pb2.BeamSearch(beam_width=1)), "beam_width",
     "at least n (2)"),
    (generation_pb2.GenerateRequest(text="hi", guided=common_pb2.GuidedDecoding(choice=common_pb2.Choices())),
     "choice", "at least one string"),
    (generation_pb2.GenerateRequest(text="hi", guided=common_pb2.GuidedDecoding(regex="a" * (64 * 1024 + 1))),
     "regex", "at most 65536"),
    (generation_pb2.GenerateRequest(text="hi", guided=common_pb2.GuidedDecoding(
        choice=common_pb2.Choices(choices=["x" * 40000, "y" * 40000]))), "choice", "80000 bytes"),
    (generation_pb2.GenerateRequest(text="hi", guided=common_pb2.GuidedDecoding(json_schema="{")), "json_schema",
     "is not JSON"),
    (generation_pb2.GenerateRequest(text="hi", guided=common_pb2.GuidedDecoding(grammar="")), "grammar", "is empty"),
    (generation_pb2.GenerateRequest(text="hi", response=generation_pb2.ResponseOptions(prompt_logprobs=21)),
     "prompt_logprobs", "[0, 20]"),
    (generation_pb2.GenerateRequest(chat=generation_pb2.Chat(), response=generation_pb2.ResponseOptions(echo=True)),
     "echo", "needs a text or token-id prompt"),
])
def test_refusals_name_the_field(request_: generation_pb2.GenerateRequest, field: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_options(request_)
    assert info.value.field == field and fragment in info.value.message


@pytest.mark.parametrize("request_, field, value", [
    (generation_pb2.GenerateRequest(text="hi", n=1000), "n", 1000),
    (generation_pb2.GenerateRequest(text="hi", n=17), "n", 17),
    (generation_pb2.GenerateRequest(text="hi", n=2, best_of=17), "best_of", 17),
    (generation_pb2.GenerateRequest(text="hi", best_of=2**32 - 1), "best_of", 2**32 - 1),
    (generation_pb2.GenerateRequest(text="hi", beam_search=common_pb2.BeamSearch(beam_width=17)), "beam_width", 17),
])
def test_more_sequences_than_the_cap_are_invalid_argument(request_: generation_pb2.GenerateRequest, field: str,
                                                          value: int) -> None:
    # The REST gateway's --max-n default; the public gRPC API took n = 1000 (issue 26).
    assert MAX_SEQUENCES == 16
    with pytest.raises(InvalidRequestError) as info:
        check_options(request_)
    assert info.value.field == field and info.value.message == f"must be at most 16, got {value}"
    assert status_for(info.value) == (grpc.StatusCode.INVALID_ARGUMENT, f"{field}: must be at most 16, got {value}")


def test_the_cap_itself_is_accepted() -> None:
    check_options(generation_pb2.GenerateRequest(text="hi", n=16, best_of=16))
    check_options(generation_pb2.GenerateRequest(text="hi", n=16, beam_search=common_pb2.BeamSearch(beam_width=16)))
