"""The offline API's logprobs in vLLM's shapes, on the default model: a script written for vLLM runs unchanged,
and each ``Logprob``'s logprob, rank and decoded_token agree with transformers' model and tokenizer of the same
GGUF file (references no one here wrote)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import engine
from engine import LLM, Logprob, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
K = 4
LOGPROB_TOL = 2e-3  # float32 here and in transformers, summed in other orders

# A script as vLLM's users write it (vLLM's names only); run with `vllm` resolving to this package.
VLLM_SCRIPT = """
from vllm import LLM, SamplingParams

llm = LLM(dtype="float32", kv_cache_memory="128MiB", seed=0)
params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, logprobs=4, prompt_logprobs=4, ignore_eos=True)
outputs = llm.generate(["The capital of France is"], params)
rows = []
for output in outputs:
    for entry in output.prompt_logprobs[1:]:
        for token_id, lp in entry.items():
            rows.append(("prompt", token_id, lp.logprob, lp.rank, lp.decoded_token))
    completion = output.outputs[0]
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        chosen = entry[token_id]
        rows.append(("sampled", token_id, chosen.logprob, chosen.rank, chosen.decoded_token))
        for other_id, lp in entry.items():
            rows.append(("top", other_id, lp.logprob, lp.rank, lp.decoded_token))
"""


@pytest.fixture(scope="module")
def script(monkeypatch_module: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch_module.setitem(sys.modules, "vllm", engine)
    scope: dict[str, Any] = {}
    exec(compile(VLLM_SCRIPT, "vllm_script.py", "exec"), scope)  # noqa: S102  (our own test text)
    return scope


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _reference(default_hf_model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at every position of ``ids`` ([len(ids), V]: row p predicts token p + 1)."""
    with torch.no_grad():
        logits = default_hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def _rank_bounds(row: torch.Tensor, token_id: int) -> tuple[int, int]:
    """The token's rank in ``row`` as vLLM counts it (the tokens at least as likely), within LOGPROB_TOL."""
    value = row[token_id].item()
    return int((row >= value + LOGPROB_TOL).sum()) + 1, int((row >= value - LOGPROB_TOL).sum())


def test_a_vllm_script_runs_unchanged_and_matches_transformers(script: dict[str, Any], default_hf_model: Any,
                                                               default_hf_tokenizer: Any) -> None:
    (output,) = script["outputs"]
    completion = output.outputs[0]
    ids = output.prompt_token_ids + completion.token_ids
    ref = _reference(default_hf_model, ids)
    prompt_len = len(output.prompt_token_ids)
    # Prompt: None first, then {prompt token first, then the K most likely with ranks 1..K}.
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == prompt_len
    for p, entry in enumerate(output.prompt_logprobs[1:], start=1):
        _check_position(entry, ids[p], ref[p - 1], default_hf_tokenizer)
    # Generated: one dict per token, the sampled token first.
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    ranks = []
    for j, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        _check_position(entry, token_id, ref[prompt_len + j - 1], default_hf_tokenizer)
        ranks.append(entry[token_id].rank)
    assert any(r > 1 for r in ranks), ranks  # sampled at temperature 1: not every token is the likeliest
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), abs=1e-4)
    assert all(isinstance(r[2], float) and isinstance(r[3], int) and isinstance(r[4], str) for r in script["rows"])


def _check_position(entry: dict[int, Logprob], token_id: int, ref: torch.Tensor, hf_tokenizer: Any) -> None:
    assert entry is not None and next(iter(entry)) == token_id
    assert all(isinstance(v, Logprob) for v in entry.values())
    chosen = entry[token_id]
    assert chosen.logprob == pytest.approx(ref[token_id].item(), abs=LOGPROB_TOL)
    low, high = _rank_bounds(ref, token_id)
    assert chosen.rank is not None and low <= chosen.rank <= high
    # The K most likely follow it; when it is one of them it stays first and holds its rank among them (vLLM's).
    top = sorted((list(entry.values())[1:] if len(entry) == K + 1 else list(entry.values())),
                 key=lambda lp: lp.rank or 0)
    assert [lp.rank for lp in top] == list(range(1, K + 1))
    ref_values, _ = ref.topk(K)
    assert [lp.logprob for lp in top] == pytest.approx(ref_values.tolist(), abs=LOGPROB_TOL)
    for tid, lp in entry.items():
        assert lp.decoded_token == hf_tokenizer.decode([tid])


def test_greedy_tokens_rank_first_and_no_logprobs_means_none(script: dict[str, Any]) -> None:
    llm: LLM = script["llm"]
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))
    completion = out.outputs[0]
    assert [list(e) for e in completion.logprobs] == [[t] for t in completion.token_ids]  # logprobs=0: itself only
    assert all(e[t].rank == 1 for t, e in zip(completion.token_ids, completion.logprobs))
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None
    assert out.prompt_logprobs is None
