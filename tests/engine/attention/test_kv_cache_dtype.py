"""``--kv-cache-dtype``: parsing, validation, forwarding by ``sluice serve``, and its effect on the cache."""
from __future__ import annotations

import argparse

import pytest
import torch

from engine import LLM, InvalidRequestError, SamplingParams
from engine.config import EngineConfig, default_max_queued_requests
from engine.entrypoints.args import add_engine_args, config_from_args
from services.supervisor import engine_flags


def test_flag_parses_and_defaults_to_auto() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).kv_cache_dtype == "auto"
    assert config_from_args(parser.parse_args(["--kv-cache-dtype", "float16"])).kv_cache_dtype == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int3"])


@pytest.mark.parametrize("value, words", [("fp8", "fp8 KV caches are not supported"), ("int8", "unknown KV cache")])
def test_unsupported_values_name_the_field(value: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as info:
        EngineConfig(kv_cache_dtype=value)
    assert "kv_cache_dtype" in str(info.value)


def test_sluice_serve_passes_it_to_the_engine() -> None:
    served = EngineConfig(max_queued_requests=default_max_queued_requests(128))   # as `sluice serve` builds it
    assert engine_flags(served.with_changes(kv_cache_dtype="float16")) == ["--kv-cache-dtype", "float16"]
    assert engine_flags(served) == []


@pytest.mark.slow
def test_float16_cache_holds_twice_the_blocks_and_gives_the_same_greedy_text() -> None:
    settings = {"dtype": "float32", "kv_cache_memory": "64MiB", "seed": 0}
    full, half = LLM(**settings), LLM(kv_cache_dtype="float16", **settings)
    assert half.engine.num_blocks == 2 * full.engine.num_blocks
    assert {c.dtype for c in half.engine.executor.worker.runner.stage.kv_caches} == {torch.float16}
    assert {c.dtype for c in full.engine.executor.worker.runner.stage.kv_caches} == {torch.float32}
    topics = ["the sea", "mountains", "a cat", "Python", "the moon", "bread", "rain", "music"]
    prompts = [f"Request {i}: write one sentence about {t} and number {i * 7}." for i, t in enumerate(topics)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    expected, got = full.generate(prompts, params), half.generate(prompts, params)
    # Keys and values rounded to float16 move this model's logprobs by ~3e-3 (measured): greedy text holds.
    for a, b in zip(expected, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for step, token in enumerate(a.outputs[0].token_ids):
            la, lb = a.outputs[0].logprobs[step][token], b.outputs[0].logprobs[step][token]
            assert abs(getattr(la, "logprob", la) - getattr(lb, "logprob", lb)) < 0.02
