"""Prompt logprobs and priorities at the engine's edges, on the default model: the offline API's vLLM shape, the
gRPC servicer's conversion both ways, and LLM.generate(priority=...)."""
from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.core.outputs import EngineCoreOutput
from engine.entrypoints.grpc_servicer import output_to_pb, sampling_params_from_pb
from proto.sluice.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
K = 3


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="128MiB", max_num_batched_tokens=64)


def test_offline_prompt_logprobs_have_vllms_shape(llm: LLM) -> None:
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K))
    plp = out.prompt_logprobs
    ids = out.prompt_token_ids
    assert plp is not None and len(plp) == len(ids) >= 3 and plp[0] is None
    for token_id, entry in zip(ids[1:], plp[1:]):
        assert entry is not None and next(iter(entry)) == token_id   # the prompt token first, as vLLM
        top = [(t, v.logprob) for t, v in list(entry.items())[1:]]
        assert len(entry) in (K, K + 1) and all(v.logprob <= 0 for v in entry.values())
        if len(entry) == K + 1:   # the prompt token is not among the top K: all of them are likelier
            assert min(v for _, v in top) >= entry[token_id].logprob and [v for _, v in top] == sorted(
                (v for _, v in top), reverse=True)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_a_prompt_logprob_is_the_logprob_the_decode_sampled_it_with(llm: LLM) -> None:
    # The first greedy token's logprob at decode == its prompt logprob once it is appended to the prompt.
    (first,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
    token = first.outputs[0].token_ids[0]
    assert first.outputs[0].cumulative_logprob is not None
    ids = first.prompt_token_ids + [token]
    (second,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert second.prompt_logprobs is not None and second.prompt_logprobs[-1] is not None
    assert second.prompt_logprobs[-1][token].logprob == pytest.approx(first.outputs[0].cumulative_logprob, abs=1e-4)


def test_the_grpc_servicer_carries_them_both_ways(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    request = engine_pb2.EngineGenerateRequest(
        request_id="pb", prompt_logprobs=K, sampling=common_pb2.SamplingParameters(temperature=0.0),
        stopping=engine_pb2.EngineStoppingCriteria(max_tokens=2, ignore_eos=True))
    params = sampling_params_from_pb(request)
    assert params.prompt_logprobs == K
    assert sampling_params_from_pb(engine_pb2.EngineGenerateRequest(request_id="none")).prompt_logprobs is None
    core = llm.engine
    core.add_request("pb", ids, params)
    outputs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    first, last = output_to_pb(outputs[0]), output_to_pb(outputs[-1])
    assert len(last.prompt_logprobs) == 0 and len(first.prompt_logprobs) == len(ids)
    head, *rest = first.prompt_logprobs
    assert head.token_id == ids[0] and not head.HasField("logprob") and len(head.top_logprobs) == 0
    (offline,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=K))
    assert offline.prompt_logprobs is not None
    for entry, expected in zip(rest, offline.prompt_logprobs[1:]):
        assert expected is not None and not entry.text and not entry.text_bytes
        assert entry.HasField("logprob") and entry.logprob == pytest.approx(expected[entry.token_id].logprob, abs=1e-6)
        assert len(entry.top_logprobs) == K
        for top in entry.top_logprobs:
            assert top.logprob == pytest.approx(expected[top.token_id].logprob, abs=1e-6)
    assert [e.token_id for e in first.prompt_logprobs] == ids


def test_offline_priority_needs_the_priority_policy_and_one_per_prompt(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=1), priority=[1])
    assert info.value.field == "priority"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=1), priority=[0])
    assert info.value.field == "priority" and "2 prompts" in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([PROMPT], SamplingParams(max_tokens=1), priority=[0])) == 1
