"""Mixture-of-experts and latent-attention models through the whole engine (offline API): the scheduler's batches,
chunked prefill, prefix-cache hits on the latent cache and preemption by recompute all give transformers' own greedy
continuations, and KV blocks all return to the pool."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine import LLM, SamplingParams
from tests.engine.models.moe_factory import greedy_reference, write_checkpoint

pytestmark = pytest.mark.slow

KINDS = ["qwen2_moe", "deepseek_v3"]
MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 128, (12,), generator=gen).tolist()   # 3 full blocks of 4 every prompt starts with
    return [shared + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (3, 9, 5, 14, 1, 7)]


@pytest.fixture(scope="module", params=KINDS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_scheduler_batches_chunks_hits_and_preempts_like_transformers(model: tuple[PreTrainedModel, Path]) -> None:
    hf, path = model
    prompts = _prompts()
    expected = [greedy_reference(hf, p, MAX_TOKENS) for p in prompts]
    # 6 prompts of 13-26 tokens growing by 10, in blocks of 4, need ~40 blocks: 16 force preemptions; a budget of
    # 16 tokens a step chunks every prompt.
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=6,
              seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.prefix_cache_hits > 0   # the shared 12 tokens: latent (or KV) blocks reused
    info = llm.engine.info()
    assert info["free_kv_blocks"] == info["total_kv_blocks"]


def test_expert_parallel_engine_gives_the_single_process_tokens(model: tuple[PreTrainedModel, Path]) -> None:
    hf, path = model
    prompts = _prompts()[:3]
    expected = [greedy_reference(hf, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
              distributed_executor_backend="mp", num_kv_blocks=64, block_size=4, seed=0)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    finally:
        llm.close()
    assert got == expected


@pytest.mark.parametrize("settings", [{"num_scheduler_steps": 3}, {"async_scheduling": True}],
                         ids=["multi-step", "async-scheduling"])
def test_multi_step_and_async_scheduling_give_the_same_tokens(model: tuple[PreTrainedModel, Path],
                                                              settings: dict[str, object]) -> None:
    hf, path = model
    prompts = _prompts()[:4]
    expected = [greedy_reference(hf, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64, seed=0, **settings)  # type: ignore[arg-type]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)] == expected
