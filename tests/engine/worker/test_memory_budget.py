"""Honest memory budgets (issue 44, part 6): start-up logs the KV cache's byte arithmetic, and a model or a context
that does not fit is refused with it and with the largest --max-model-len that fits. Every figure is checked
against sizes computed here: one block from the checkpoint's config (2 x layers x block x KV heads x head width x
4 bytes), the weights from transformers' own model of the same checkpoint, the device's from the scripted fake
accelerator of test_kv_profile."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from common.errors import InvalidRequestError
from engine.config import EngineConfig, parse_human_int
from engine.entrypoints.args import add_engine_args
from engine.worker.worker import Worker
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.engine.worker.test_kv_profile import FakeAccelerator, _blocks

BLOCK = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny")
    return path, save_tiny_llama(path)


def sizes(hf: LlamaForCausalLM) -> tuple[int, int]:
    """(one block's bytes, the weights' bytes: transformers' parameters, plus the rotary tables Sluice keeps:
    cos and sin, max_position_embeddings x head_dim / 2 each, float32)"""
    c = hf.config
    head_dim = c.hidden_size // c.num_attention_heads
    per_block = 2 * c.num_hidden_layers * BLOCK * c.num_key_value_heads * head_dim * 4
    rotary = 2 * c.max_position_embeddings * (head_dim // 2) * 4
    return per_block, sum(p.numel() * 4 for p in hf.parameters()) + rotary


def worker(path: Path, **overrides: object) -> Worker:
    return Worker(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, **overrides))  # type: ignore[arg-type]


def test_a_context_that_does_not_fit_is_refused_with_the_arithmetic(
        checkpoint: tuple[Path, LlamaForCausalLM]) -> None:
    path, hf = checkpoint
    per_block, weights = sizes(hf)
    memory = 5 * per_block + 123  # five blocks = 80 tokens, and a rest too small for a sixth
    with pytest.raises(InvalidRequestError) as err:
        worker(path, kv_cache_memory=memory, max_model_len=200).num_kv_blocks()
    assert err.value.field == "max_model_len"
    assert err.value.message == (
        f"--max-model-len 200 needs 13 blocks ({13 * per_block} B) for one sequence, more than the cache holds: "
        f"--kv-cache-memory {memory} B = {memory} B for the KV cache; one block = 2 x 2 layers x 16 tokens x 2 KV "
        f"heads x 16 x 4 B = {per_block} B; {memory} B // {per_block} B = 5 blocks x 16 tokens = 80 tokens "
        f"(held besides: weights {weights} B); the largest --max-model-len that fits is 80 (one sequence of it at "
        f"a time), or give the cache {13 * per_block - memory} B more")
    # what it names fits
    assert worker(path, kv_cache_memory=memory, max_model_len=80).num_kv_blocks() == 5


def test_no_room_for_one_block_is_refused_naming_the_shortfall(checkpoint: tuple[Path, LlamaForCausalLM]) -> None:
    path, hf = checkpoint
    per_block, _ = sizes(hf)
    with pytest.raises(InvalidRequestError) as err:
        worker(path, kv_cache_memory=per_block - 100).num_kv_blocks()
    assert err.value.field == "kv_cache_memory"
    assert err.value.message.startswith(f"{per_block - 100} B leave no room for one KV block ({per_block} B), 100 B "
                                        f"short: --kv-cache-memory {per_block - 100} B = ")


def test_start_up_logs_the_arithmetic(checkpoint: tuple[Path, LlamaForCausalLM],
                                      caplog: pytest.LogCaptureFixture) -> None:
    path, hf = checkpoint
    per_block, weights = sizes(hf)
    with caplog.at_level(logging.INFO, logger="engine.worker.worker"):
        assert worker(path, kv_cache_memory=100 * per_block, max_model_len=256, max_num_seqs=8).num_kv_blocks() == 100
    assert (f"KV cache memory: --kv-cache-memory {100 * per_block} B = {100 * per_block} B for the KV cache; one "
            f"block = 2 x 2 layers x 16 tokens x 2 KV heads x 16 x 4 B = {per_block} B; {100 * per_block} B // "
            f"{per_block} B = 100 blocks x 16 tokens = 1600 tokens (held besides: weights {weights} B); 6 sequences "
            f"of max_model_len 256 fit at once (--max-num-seqs 8: more wait, or are preempted, when all are that "
            f"long)") in caplog.text


def test_a_model_that_does_not_fit_the_device_is_refused_with_the_profiled_arithmetic(
        checkpoint: tuple[Path, LlamaForCausalLM]) -> None:
    path, hf = checkpoint
    per_block, _ = sizes(hf)
    w = worker(path, max_num_batched_tokens=96, max_num_seqs=6, device_memory_utilization=0.5)
    # 1000 blocks of device, half of it ours; the weights take 300, a step's activations 150, others 60.
    total, weights, activation, others = 1000 * per_block, 300 * per_block, 150 * per_block, 60 * per_block
    allocated = weights + per_block  # the profile step's own one-block cache is allocated too
    fake = FakeAccelerator(free=total - allocated - others, total=total, allocated=allocated, activation=activation)
    with pytest.raises(InvalidRequestError) as err:
        _blocks(w, fake, [])
    kv = 500 * per_block - weights - activation - others
    assert err.value.field == "device_memory_utilization"
    assert err.value.message.startswith(
        f"{kv} B leave no room for one KV block ({per_block} B), {per_block - kv} B short: device {total} B x 0.5 = "
        f"{500 * per_block} B - weights {weights} B - activation peak (a 96-token step over --max-num-seqs 6) "
        f"{activation} B - other use {others} B = {kv} B for the KV cache; one block = ")


@pytest.mark.parametrize(("text", "expected"), [("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("4G", 4 * 2**30),
                                                ("4g", 4 * 10**9), ("512M", 512 * 2**20), ("1000", 1000)])
def test_kv_cache_memory_bytes_parses_units_as_vllm_does(text: str, expected: int) -> None:
    """vLLM's human_readable_int: its docstring's examples (1k, 1K, 25.6k) and its suffix tables."""
    assert parse_human_int(text) == expected
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--kv-cache-memory-bytes", text]).kv_cache_memory == expected


def test_binary_suffixes_take_no_decimals_as_in_vllm() -> None:
    with pytest.raises(InvalidRequestError, match="decimals"):
        parse_human_int("1.5G")
    assert parse_human_int("1.5g") == 1_500_000_000
