"""The offline API's beam search and best_of (vLLM's ``LLM.beam_search`` and ``SamplingParams(best_of=...)``),
on the default GGUF model."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.llm import BeamSearchParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_num_seqs=8, seed=0)


def test_beam_search_returns_the_width_best_beams_best_first(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=1.0)
    [result] = llm.beam_search([PROMPT], params)
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert len(result.sequences) == 3
    scores = []
    for seq in result.sequences:
        assert seq.tokens[:len(prompt_ids)] == prompt_ids
        output = seq.tokens[len(prompt_ids):]
        assert 1 <= len(output) <= 6 and seq.finish_reason in ("stop", "length")
        assert seq.text == llm.get_tokenizer().decode(output, skip_special_tokens=True)
        scores.append(seq.cum_logprob / len(output))
    assert scores == sorted(scores, reverse=True) and len({tuple(s.tokens) for s in result.sequences}) == 3
    # Deterministic: the same search again returns the same beams.
    assert llm.beam_search(PROMPT, params) == [result]
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.num_blocks


def test_best_of_returns_n_outputs_ranked_by_cumulative_logprob(llm: LLM) -> None:
    [out] = llm.generate(PROMPT, SamplingParams(n=2, best_of=4, seed=3, max_tokens=5, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1]
    cumulative = [c.cumulative_logprob for c in out.outputs]
    assert all(c is not None for c in cumulative) and cumulative[0] >= cumulative[1]  # type: ignore[operator]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" and c.logprobs is None for c in out.outputs)
