"""Prefill/decode disaggregation over MooncakeConnector (Mooncake's transfer engine over TCP on 127.0.0.1) between
two real engines in one process: the decode engine pulls the prefill engine's full blocks and continues with
exactly transformers' greedy tokens (the transport's faults: tests/engine/worker/test_mooncake_transport.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.kv_transfer_config import KVTransferConfig
from tests.engine.core.test_disagg import BLOCK, decode, free_is_total, prefill, prompt_of, reference
from tests.engine.core.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny-disagg-mooncake")
    return path, save_tiny_llama(path)


def make_core(checkpoint: Path, role: str) -> EngineCore:
    transfer = KVTransferConfig("MooncakeConnector", role, kv_ip="127.0.0.1")
    return EngineCore(EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=48, block_size=BLOCK,
                                   async_scheduling=False, kv_transfer_config=transfer), show_progress=False)


@pytest.fixture(scope="module")
def pair(tiny: tuple[Path, LlamaForCausalLM]) -> Iterator[tuple[EngineCore, EngineCore]]:
    producer, consumer = make_core(tiny[0], "kv_producer"), make_core(tiny[0], "kv_consumer")
    try:
        yield producer, consumer
    finally:
        producer.close()
        consumer.close()


def test_the_decode_engine_pulls_the_full_blocks_over_tcp(pair: tuple[EngineCore, EngineCore],
                                                          tiny: tuple[Path, LlamaForCausalLM]) -> None:
    producer, consumer = pair
    for i, length in enumerate((13, 22)):
        prompt = prompt_of(length, 40 + i)
        before = dict(consumer.scheduler_stats())
        first = prefill(producer, f"mp{i}", prompt)
        remote = first.kv_transfer
        assert remote is not None and remote.transport == "mooncake"
        assert remote.remote_address.startswith("127.0.0.1:") and "|0x" in remote.remote_address
        rest = decode(consumer, f"md{i}", prompt, first)
        assert first.new_token_ids + [t for o in rest for t in o.new_token_ids] == reference(tiny[1], prompt)
        after = consumer.scheduler_stats()
        assert after["kv_transfer_blocks_received"] - before["kv_transfer_blocks_received"] == length // BLOCK
        assert after["prompt_tokens"] - before["prompt_tokens"] == length % BLOCK
        producer.abort_requests([f"mp{i}"])
        assert free_is_total(producer) and free_is_total(consumer)
    assert consumer.scheduler_stats()["kv_transfer_fallbacks"] == 0

