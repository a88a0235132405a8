"""The mp executor: a replica of tensor × pipeline parallel ranks (real processes, gloo on 127.0.0.1) answers as
one process does, through the offline API, with chunked prefill, prefix-cache hits and preemption in every run."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.config import KernelSettings
from tests.engine.executor.checkpoints import alive, child_pids, write_checkpoint

pytestmark = pytest.mark.slow

# 24 blocks of 4 tokens for prompts that need ~55: requests are preempted and recomputed; a 32-token budget chunks
# the 40-token prompt; two prompts share four blocks of prefix.
ENGINE: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=32,
                              max_num_seqs=8, num_threads=1, seed=0)
PREFIX = list(range(3, 19))
PROMPTS = [PREFIX + [40, 41, 42], PREFIX + [50, 51], list(range(60, 100)), [7, 8, 9], [100, 101, 102, 103, 104],
           [20, 30, 40, 50, 60, 70]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)
TOL = 1e-4   # float32; only the order of the tensor-parallel sums differs


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    preemptions: int
    prefix_cache_hits: int
    kv_layers: int     # layers of the driver's KV cache
    kv_heads: int      # KV heads of the driver's KV cache


def generate(path: Path, **parallel: Any) -> Run:
    with LLM(str(path), **ENGINE, **parallel) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)   # its prefix is cached by now
        outs = [o.outputs[0] for o in first + again]
        sched = llm.engine.scheduler
        runner = llm.engine.executor.worker.runner   # type: ignore[attr-defined]
        assert runner is not None
        cache = runner.stage.kv_caches
        return Run([o.token_ids for o in outs], [o.logprobs or [] for o in outs], sched.num_preemptions,
                   sched.prefix_cache_hits, len(cache), cache[0].shape[-2])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {kind: write_checkpoint(kind, tmp_path_factory.mktemp(kind)) for kind in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="module")
def one_process(checkpoints: dict[str, Path]) -> dict[str, Run]:
    """Each model on the uniproc executor: the reference."""
    return {kind: generate(path) for kind, path in checkpoints.items()}


def test_the_reference_runs_exercise_preemption_chunking_and_the_prefix_cache(one_process: dict[str, Run]) -> None:
    for run in one_process.values():
        assert run.preemptions > 0 and run.prefix_cache_hits >= len(PREFIX)
        assert [len(t) for t in run.tokens] == [20] * (len(PROMPTS) + 1)
        assert run.tokens[-1] == run.tokens[0]


def test_mp_with_one_rank_is_the_uniproc_executor_exactly(checkpoints: dict[str, Path],
                                                          one_process: dict[str, Run]) -> None:
    assert generate(checkpoints["llama"], distributed_executor_backend="mp") == one_process["llama"]


@pytest.mark.parametrize("kind, tp, pp", [("llama", 2, 1), ("llama", 1, 2), ("llama", 2, 2), ("qwen2", 2, 1),
                                          ("qwen2", 1, 2), ("qwen3", 2, 1), ("qwen3", 1, 2)])
def test_a_parallel_replica_answers_as_one_process(kind: str, tp: int, pp: int, checkpoints: dict[str, Path],
                                                   one_process: dict[str, Run]) -> None:
    ref = one_process[kind]
    got = generate(checkpoints[kind], tensor_parallel_size=tp, pipeline_parallel_size=pp,
                   distributed_executor_backend="mp")
    # The driver holds its stage's layers and its share of the KV heads: the model really is split.
    assert (got.kv_layers, got.kv_heads) == (ref.kv_layers // pp, ref.kv_heads // tp)
    assert got.tokens == ref.tokens
    # The scheduler saw the same tokens, so it made the same decisions.
    assert (got.preemptions, got.prefix_cache_hits) == (ref.preemptions, ref.prefix_cache_hits)
    for seq_got, seq_ref in zip(got.logprobs, ref.logprobs, strict=True):
        for top_got, top_ref in zip(seq_got, seq_ref, strict=True):
            assert top_got.keys() == top_ref.keys()
            assert max(abs(top_got[t].logprob - top_ref[t].logprob) for t in top_ref) <= TOL


PLAIN = SamplingParams(temperature=0.0, max_tokens=16)
QUESTIONS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4, 5,"]
# Every row on the dense (dequantized) kernels: a micro-batch has fewer rows than the step, and the GGUF block
# kernels take small batches only, which would change the sums' order between the two runs.
GGUF: dict[str, Any] = dict(dtype="float32", num_threads=1, max_num_batched_tokens=64,
                            kernels=KernelSettings(quant_max_rows=0))


def test_the_default_model_under_two_pipeline_stages_answers_as_one_process() -> None:
    with LLM(**GGUF) as one:
        expected = [o.outputs[0].text for o in one.generate(QUESTIONS, PLAIN)]
    with LLM(**GGUF, pipeline_parallel_size=2) as two:
        assert [o.outputs[0].text for o in two.generate(QUESTIONS, PLAIN)] == expected
    assert "Paris" in expected[0]


def test_tensor_parallel_on_the_default_model_is_refused_at_start_up_and_leaves_no_process() -> None:
    before = child_pids(os.getpid())
    with pytest.raises(ValueError, match="the model's 9 attention heads do not divide over tensor_parallel_size 2"):
        LLM(tensor_parallel_size=2, num_threads=1)
    assert not {pid for pid in child_pids(os.getpid()) - before if alive(pid)}
