"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) against transformers' log_softmax over the prompt's
logits, on a tiny random Llama in float32: across prefill chunks, with a prefix-cache hit available, after a
preemption in the middle of the prompt, and only for the requests that ask."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.outputs import EngineCoreOutput
from engine.core.request import PromptLogprobs, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.worker.model_runner import RunnerOutput
from tests.engine.core.tiny_llama import save_tiny_llama

TOL = 1e-4     # fp32 vs fp32: only summation order differs
K = 3
BUDGET = 16    # max_num_batched_tokens: a 41-token prompt takes three chunks
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 128, 41)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny")
    return path, save_tiny_llama(path)


def _core(path: Path, **kw: object) -> EngineCore:
    args: dict[str, object] = dict(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=BUDGET,
                                   num_kv_blocks=64)
    args.update(kw)
    return EngineCore(EngineConfig(**args))  # type: ignore[arg-type]


def _run(core: EngineCore) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    return outputs


def _assert_matches_transformers(plp: PromptLogprobs, model: LlamaForCausalLM, prompt: list[int], k: int = K
                                 ) -> None:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    token = logprobs.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    top_lp, top_ids = logprobs.topk(k, -1)
    assert plp.token_ids.tolist() == prompt
    assert plp.logprobs.shape == (len(prompt) - 1,) and plp.top_ids.shape == (len(prompt) - 1, k)
    np.testing.assert_allclose(plp.logprobs, token.numpy(), atol=TOL, rtol=0)
    assert plp.top_ids.tolist() == top_ids.tolist()
    np.testing.assert_allclose(plp.top_logprobs, top_lp.numpy(), atol=TOL, rtol=0)


def test_across_chunks_with_a_prefix_hit_available(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    path, model = tiny
    core = _core(path)
    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    core.add_request("warm", PROMPT, SamplingParams(**greedy))  # type: ignore[arg-type]
    _run(core)
    core.add_request("asked", PROMPT, SamplingParams(prompt_logprobs=K, **greedy))  # type: ignore[arg-type]
    chunks: list[int] = []
    outputs: list[EngineCoreOutput] = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
        assert core.last_step is not None
        chunks.append(core.last_step.num_scheduled_tokens[SequenceId("asked")])
    # Every prompt position computed (no cached block taken), in budget-sized chunks, then 2 decodes.
    assert chunks == [16, 16, 9, 1, 1]
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert outputs[0].prompt_logprobs is not None and [o.prompt_logprobs for o in outputs[1:]] == [None, None]
    _assert_matches_transformers(outputs[0].prompt_logprobs, model, PROMPT)
    # The hit was there to take (and the asking request kept the cache filled): a plain request takes it.
    core.add_request("plain", PROMPT, SamplingParams(**greedy))  # type: ignore[arg-type]
    assert _run(core)[0].num_cached_tokens == 40
    assert core.info()["free_kv_blocks"] == core.num_blocks


def test_only_the_asking_request_pays_and_each_sequence_gets_them(tiny: tuple[Path, LlamaForCausalLM],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, model = tiny
    core = _core(path, max_num_batched_tokens=64)
    runs: list[RunnerOutput] = []
    execute = core.executor.execute_model

    def recording(sched: object) -> RunnerOutput:
        run = execute(sched)  # type: ignore[arg-type]
        runs.append(run)
        return run

    monkeypatch.setattr(core.executor, "execute_model", recording)
    other = PROMPT[::-1]
    core.add_request("asked", PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2, ignore_eos=True,
                                                   prompt_logprobs=0))
    core.add_request("plain", other, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    outputs = _run(core)
    assert [sorted(map(str, r.prompt_logprobs)) for r in runs] == [[str(SequenceId("asked"))], [], []]
    firsts = {o.seq_id: o for o in reversed(outputs)}   # each sequence's first output
    assert firsts[SequenceId("plain")].prompt_logprobs is None
    first, second = firsts[SequenceId("asked", 0)].prompt_logprobs, firsts[SequenceId("asked", 1)].prompt_logprobs
    assert first is not None and first is second
    assert sum(o.prompt_logprobs is not None for o in outputs) == 2
    _assert_matches_transformers(first, model, PROMPT, k=0)


def test_a_preemption_in_the_middle_of_the_prompt_recomputes_them(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    path, model = tiny
    core = _core(path, scheduling_policy="priority", max_num_seqs=1)
    core.add_request("asked", PROMPT, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K),
                     priority=1)
    assert core.step() == []   # its first chunk of 16
    core.add_request("urgent", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2), priority=0)
    outputs = _run(core)
    assert core.scheduler.num_preemptions == 1
    asked = [o for o in outputs if o.request_id == "asked"]
    assert asked[0].prompt_logprobs is not None and asked[-1].request_finished
    _assert_matches_transformers(asked[0].prompt_logprobs, model, PROMPT)
    assert core.info()["free_kv_blocks"] == core.num_blocks


def test_a_one_token_prompt_has_none_to_compute(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    core = _core(tiny[0])
    core.add_request("one", [9], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    (out,) = _run(core)
    plp = out.prompt_logprobs
    assert plp is not None and plp.token_ids.tolist() == [9]
    assert plp.logprobs.shape == (0,) and plp.top_ids.shape == (0, 2) and plp.top_logprobs.shape == (0, 2)
