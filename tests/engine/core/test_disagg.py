"""Prefill/decode disaggregation between two real engines in one process (a tiny random Llama on the CPU, the
shared-memory transport): a prefill engine computes the prompt and its first token and holds the blocks; a decode
engine given the prompt plus that token pulls the blocks and continues with exactly transformers' greedy tokens,
computing only the prompt's last partial block. Holds end on abort or timeout; a failed pull is recomputed."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.kv_transfer_params import RemoteKV
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import SamplingParams
from engine.kv_transfer_config import KVTransferConfig
from engine.worker.kv_pull import FAULT_ENV
from tests.engine.core.tiny_llama import save_tiny_llama

BLOCK = 4
MAX_TOKENS = 6
LENGTHS = (3, 8, 13, 22, 31)   # under one block, whole blocks, and a partial last block


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny-disagg")
    return path, save_tiny_llama(path)


def make_core(checkpoint: Path, role: str | None, **extra: float) -> EngineCore:
    transfer = None if role is None else KVTransferConfig("SharedMemoryConnector", role, **extra)  # type: ignore[arg-type]
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


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(length)]


def reference(model: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens from scratch each step, EOS included (the requests ignore it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def drain(core: EngineCore) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    deadline = time.monotonic() + 60
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        outputs += core.step()
    return outputs


def params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prefill(producer: EngineCore, rid: str, prompt: list[int]) -> EngineCoreOutput:
    producer.add_request(rid, prompt, params(), kv_transfer=RemoteKV(do_remote_decode=True))
    outputs = drain(producer)
    assert len(outputs) == 1 and outputs[0].request_finished
    return outputs[0]


def decode(consumer: EngineCore, rid: str, prompt: list[int], first: EngineCoreOutput) -> list[EngineCoreOutput]:
    consumer.add_request(rid, prompt + first.new_token_ids, params(), resumed_output_tokens=1,
                         kv_transfer=first.kv_transfer)
    return drain(consumer)


def free_is_total(core: EngineCore) -> bool:
    bm = core.scheduler.block_manager
    if bm.num_free_blocks != core.num_blocks:
        return False
    bm.check_invariants([])
    return True


def test_split_requests_equal_transformers_and_pull_only_the_full_blocks(
        pair: tuple[EngineCore, EngineCore], tiny: tuple[Path, LlamaForCausalLM]) -> None:
    producer, consumer = pair
    for i, length in enumerate(LENGTHS):
        prompt = prompt_of(length, i)
        expected = reference(tiny[1], prompt)
        before = dict(consumer.scheduler_stats())
        first = prefill(producer, f"p{i}", prompt)
        remote = first.kv_transfer
        assert remote is not None and first.new_token_ids == expected[:1]
        assert len(remote.remote_block_ids) == length // BLOCK == len(remote.block_hashes)
        assert remote.transport == "shm" and remote.layout.startswith("float32 2x2x48x4x2x16")
        if length >= BLOCK:   # held for the decode engine until released
            assert not free_is_total(producer)
        rest = decode(consumer, f"d{i}", prompt, first)
        tokens = [t for out in rest for t in out.new_token_ids]
        assert first.new_token_ids + tokens == expected
        assert rest[-1].finish_reason is not None and rest[-1].kv_transfer is None
        assert rest[0].num_prompt_tokens == length and rest[0].num_cached_tokens == (length // BLOCK) * BLOCK
        after = consumer.scheduler_stats()
        assert after["kv_transfer_blocks_received"] - before["kv_transfer_blocks_received"] == length // BLOCK
        # The decode engine computed only the prompt's last partial block (the first token is output).
        assert after["prompt_tokens"] - before["prompt_tokens"] == length % BLOCK
        assert rest[0].kv_blocks_received == length // BLOCK and all(o.kv_blocks_received == 0 for o in rest[1:])
        sent = producer.scheduler_stats()["kv_transfer_blocks_sent"]
        # The tokenizer service's release once the decode engine went on, with what it said it pulled.
        producer.release_kv_holds({f"p{i}": rest[0].kv_blocks_received})
        assert producer.scheduler_stats()["kv_transfer_blocks_sent"] - sent == length // BLOCK
        drain(producer)
        assert free_is_total(producer) and free_is_total(consumer)
    assert consumer.scheduler_stats()["kv_transfer_fallbacks"] == 0


def test_a_prefix_the_decode_engine_caches_is_not_pulled_again(pair: tuple[EngineCore, EngineCore]) -> None:
    producer, consumer = pair
    prompt = prompt_of(21, 99)
    first = prefill(producer, "again-p1", prompt)
    one = decode(consumer, "again-d1", prompt, first)
    received = consumer.scheduler_stats()["kv_transfer_blocks_received"]
    producer.abort_requests(["again-p1"])   # a hold ended by a plain abort: nothing counted as sent
    first2 = prefill(producer, "again-p2", prompt)
    sent = producer.scheduler_stats()["kv_transfer_blocks_sent"]
    two = decode(consumer, "again-d2", prompt, first2)
    assert consumer.scheduler_stats()["kv_transfer_blocks_received"] == received   # all five were cached here
    assert two[0].kv_blocks_received == 0
    producer.release_kv_holds({"again-p2": two[0].kv_blocks_received})
    assert producer.scheduler_stats()["kv_transfer_blocks_sent"] == sent
    assert [t for o in one for t in o.new_token_ids] == [t for o in two for t in o.new_token_ids]
    producer.abort_requests(["again-p2"])
    drain(producer)
    assert free_is_total(producer) and free_is_total(consumer)


def test_a_first_token_that_ends_the_request_holds_nothing(pair: tuple[EngineCore, EngineCore]) -> None:
    producer, _ = pair
    producer.add_request("one", prompt_of(17, 5), params(max_tokens=1), kv_transfer=RemoteKV(do_remote_decode=True))
    outputs = drain(producer)
    assert outputs[-1].kv_transfer is None and outputs[-1].finish_reason is not None
    assert free_is_total(producer)


def test_a_failed_pull_is_recomputed_and_counted(tiny: tuple[Path, LlamaForCausalLM],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "drop")
    producer, consumer = make_core(tiny[0], "kv_producer"), make_core(tiny[0], "kv_consumer")
    try:
        prompt = prompt_of(19, 7)
        first = prefill(producer, "f", prompt)
        rest = decode(consumer, "f", prompt, first)
        assert first.new_token_ids + [t for o in rest for t in o.new_token_ids] == reference(tiny[1], prompt)
        stats = consumer.scheduler_stats()
        assert (stats["kv_transfer_fallbacks"], stats["kv_transfer_blocks_received"]) == (1, 0)
        assert stats["prompt_tokens"] == 19   # all of it computed here
        producer.abort_requests(["f"])
        assert free_is_total(producer) and free_is_total(consumer)
    finally:
        producer.close()
        consumer.close()


def test_a_hold_nobody_takes_ends_at_its_timeout(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    producer = make_core(tiny[0], "kv_producer", hold_timeout_s=0.3, transfer_timeout_s=0.1)
    try:
        first = prefill(producer, "late", prompt_of(16, 3))
        assert first.kv_transfer is not None and first.kv_transfer.hold_s == 0.3
        assert not free_is_total(producer)
        time.sleep(0.35)
        producer.check_health()   # an idle engine's loop calls it
        assert free_is_total(producer)
        assert producer.scheduler_stats()["kv_transfer_holds_expired"] == 1
        assert producer.scheduler_stats()["kv_transfer_blocks_sent"] == 0
    finally:
        producer.close()


def test_a_request_aborted_while_it_pulls_frees_its_blocks(pair: tuple[EngineCore, EngineCore]) -> None:
    producer, consumer = pair
    prompt = prompt_of(26, 11)
    first = prefill(producer, "ab-p", prompt)
    consumer.add_request("ab-d", prompt + first.new_token_ids, params(), resumed_output_tokens=1,
                         kv_transfer=first.kv_transfer)
    consumer.scheduler.schedule()   # admission starts the pull (the worker has not run it)
    assert consumer.scheduler.kv_transfer is not None and consumer.scheduler.kv_transfer.num_loading == 1
    consumer.abort_requests(["ab-d"])
    assert consumer.scheduler.kv_transfer.num_loading == 0
    outputs = drain(consumer)
    assert [o.finish_reason.name for o in outputs if o.finish_reason] == ["ABORT"]
    producer.abort_requests(["ab-p"])
    assert free_is_total(producer) and free_is_total(consumer)


def test_blocks_of_another_prompt_are_not_loaded(pair: tuple[EngineCore, EngineCore],
                                                 tiny: tuple[Path, LlamaForCausalLM]) -> None:
    producer, consumer = pair
    prompt, other = prompt_of(18, 21), prompt_of(18, 22)
    first = prefill(producer, "mm-p", prompt)
    fallbacks = consumer.scheduler_stats()["kv_transfer_fallbacks"]
    rest = decode(consumer, "mm-d", other, first)   # hashes differ: computed here
    assert consumer.scheduler_stats()["kv_transfer_fallbacks"] == fallbacks + 1
    expected = reference(tiny[1], other + first.new_token_ids)
    assert [t for o in rest for t in o.new_token_ids] == expected[:MAX_TOKENS - 1]
    producer.abort_requests(["mm-p"])
    assert free_is_total(producer) and free_is_total(consumer)


def test_requests_an_engine_cannot_honour_are_refused_naming_the_field(
        pair: tuple[EngineCore, EngineCore], tiny: tuple[Path, LlamaForCausalLM]) -> None:
    producer, consumer = pair
    with pytest.raises(InvalidRequestError, match="kv_role is kv_consumer") as e:
        consumer.add_request("x", [5, 6, 7], params(), kv_transfer=RemoteKV(do_remote_decode=True))
    assert e.value.field == "kv_transfer.do_remote_decode"
    with pytest.raises(InvalidRequestError, match="n = 1"):
        producer.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=4),
                             kv_transfer=RemoteKV(do_remote_decode=True))
    with pytest.raises(InvalidRequestError, match="kv_role is kv_producer"):
        producer.add_request("x", [5, 6, 7, 8], params(), resumed_output_tokens=1,
                             kv_transfer=RemoteKV(transport="shm", remote_address="1:2@3", remote_block_ids=(0,),
                                                  block_hashes=(b"h",)))
    colocated = make_core(tiny[0], None)
    try:
        with pytest.raises(InvalidRequestError, match="without --kv-transfer-config"):
            colocated.add_request("x", [5, 6, 7], params(), kv_transfer=RemoteKV(do_remote_decode=True))
    finally:
        colocated.close()


def test_the_engine_metrics_count_what_crossed(pair: tuple[EngineCore, EngineCore]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from engine.entrypoints.metrics import EngineMetrics

    producer, consumer = pair
    pages = {}
    for name, core in (("producer", producer), ("consumer", consumer)):
        registry = CollectorRegistry()
        registry.register(EngineMetrics(core))
        pages[name] = registry
    prompt = prompt_of(14, 31)
    first = prefill(producer, "m-p", prompt)
    rest = decode(consumer, "m-d", prompt, first)
    producer.release_kv_holds({"m-p": rest[0].kv_blocks_received})
    text = {name: generate_latest(r).decode() for name, r in pages.items()}
    block = 2 * 2 * BLOCK * 2 * 16 * 4   # K and V, 2 layers, 4 tokens, 2 KV heads of 16, float32
    assert 'sluice:kv_transfer_blocks_total{direction="received",engine="0",model_name=' in text["consumer"]
    for name, direction in (("consumer", "received"), ("producer", "sent")):
        lines = [line for line in text[name].splitlines() if line.startswith("sluice:kv_transfer_")
                 and f'direction="{direction}"' in line]
        assert [float(line.rsplit(" ", 1)[1]) for line in lines] == [3.0, 3.0 * block], lines
    assert 'kv_role="kv_producer"' in text["producer"] and 'kv_role="kv_consumer"' in text["consumer"]
    assert "sluice:kv_transfer_seconds_count" in text["consumer"]
    count = [line for line in text["consumer"].splitlines() if line.startswith("sluice:kv_transfer_seconds_count")]
    assert float(count[0].rsplit(" ", 1)[1]) == 1.0
