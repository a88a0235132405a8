"""A reasoning model's thinking in the engine (SamplingParams.reasoning): the grammar applies only after the end
token, and a spent thinking budget forces that token. Offline LLM on a tiny random checkpoint whose sampling
logit_bias steers (tests/reasoning_checkpoint.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from common.errors import InvalidRequestError
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.request import SequenceId
from engine.core.sampling_params import BeamSearch, ReasoningParams
from engine.worker.thinking import ThinkingTracker
from tests.reasoning_checkpoint import ANSWER_SCHEMA, EOS, ID, VOCAB, write_thinking_checkpoint

END = ID["</think>"]
HMM = ID["Ġhmm"]
PROMPT = {"prompt_token_ids": [ID["<|user|>"], ID["hi"], ID["<|assistant|>"], ID["<think>"]]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    path = write_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))
    with LLM(model=str(path), num_kv_blocks=64, max_num_seqs=4) as llm:
        yield llm


def run(llm: LLM, **kw: object) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0, **{"max_tokens": 24, **kw})  # type: ignore[arg-type]
    out = llm.generate(PROMPT, params)[0].outputs[0]
    return list(out.token_ids), str(out.finish_reason)


def answer_after_thinking(llm: LLM, ids: list[int]) -> object:
    assert ids.count(END) == 1
    answer = llm.get_tokenizer().decode(ids[ids.index(END) + 1:])
    value = json.loads(answer)
    jsonschema.validate(value, ANSWER_SCHEMA)
    return value


SCHEMA = StructuredOutputsParams(json=ANSWER_SCHEMA)


def test_a_spent_budget_closes_the_thinking_and_the_grammar_takes_the_answer(llm: LLM) -> None:
    ids, finish = run(llm, logit_bias={HMM: 100}, structured_outputs=SCHEMA,
                      reasoning=ReasoningParams(END, thinking_token_budget=3))
    assert ids[:4] == [HMM, HMM, HMM, END]
    answer_after_thinking(llm, ids)
    assert finish == "stop" and EOS not in ids   # the grammar's end ends it


def test_the_grammar_does_not_constrain_the_thinking(llm: LLM) -> None:
    ids, finish = run(llm, max_tokens=6, logit_bias={HMM: 100}, structured_outputs=SCHEMA,
                      reasoning=ReasoningParams(END))
    assert (ids, finish) == ([HMM] * 6, "length")   # no budget: it thinks on
    # Without reasoning, the same request is JSON from the first token.
    ids, _ = run(llm, max_tokens=6, logit_bias={HMM: 100}, structured_outputs=SCHEMA)
    assert VOCAB[ids[0]] == "{" and HMM not in ids


def test_the_grammar_starts_after_the_models_own_end_token(llm: LLM) -> None:
    ids, finish = run(llm, logit_bias={END: 100}, structured_outputs=SCHEMA,
                      reasoning=ReasoningParams(END, thinking_token_budget=10))
    assert ids[0] == END and finish == "stop"
    answer_after_thinking(llm, ids)   # the grammar masked the biased end token from then on


def test_a_zero_budget_ends_the_thinking_at_once_and_a_budget_alone_needs_no_grammar(llm: LLM) -> None:
    ids, _ = run(llm, structured_outputs=SCHEMA, reasoning=ReasoningParams(END, thinking_token_budget=0))
    assert ids[0] == END
    answer_after_thinking(llm, ids)
    ids, finish = run(llm, max_tokens=8, logit_bias={HMM: 100}, reasoning=ReasoningParams(END, 2))
    assert (ids, finish) == ([HMM, HMM, END] + [HMM] * 5, "length")   # after the thinking: unconstrained


def test_refused_fields() -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(reasoning=ReasoningParams(END, thinking_token_budget=-1))
    assert e.value.field == "thinking_token_budget"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(reasoning=ReasoningParams(END, 4), beam_search=BeamSearch(2), n=2)
    assert e.value.field == "thinking_token_budget"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(reasoning=ReasoningParams(200)).validate(vocab_size=128)
    assert e.value.field == "reasoning.end_token_id"


def test_what_steps_one_token_at_a_time() -> None:
    assert not SamplingParams(reasoning=ReasoningParams(END)).follows_each_token   # nothing to follow
    assert SamplingParams(reasoning=ReasoningParams(END, 8)).follows_each_token
    assert SamplingParams(structured_outputs=SCHEMA).follows_each_token


def test_the_tracker_looks_at_each_token_once_and_forgets_on_release() -> None:
    tracker, seq = ThinkingTracker(), SequenceId("r", 0)
    reasoning = ReasoningParams(END, thinking_token_budget=3)
    out = [HMM, HMM]
    assert not tracker.has_ended(seq, reasoning, out) and tracker.forced_token(seq, reasoning, out) is None
    out.append(HMM)
    assert tracker.forced_token(seq, reasoning, out) == END
    out += [END, HMM]
    assert tracker.has_ended(seq, reasoning, out) and tracker.forced_token(seq, reasoning, out) is None
    tracker.release([seq])
    assert not tracker.has_ended(seq, reasoning, [HMM])   # forgotten: another history starts from scratch
    assert tracker.has_ended(SequenceId("r", 1), reasoning, [END])
