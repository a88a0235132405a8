"""KV cache events, received as a vLLM subscriber receives them: a pyzmq SUB socket, msgpack decoded into vLLM's
struct shapes written here (not imported from the engine), hashes recomputed with hashlib / cbor2 / pickle."""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import pytest
import zmq

from common.errors import InvalidRequestError
from common.procs import free_port
from engine.config import EngineConfig, KVEventsConfig
from engine.core.block_hashing import make_block_hasher
from engine.core.block_manager import BlockManager
from engine.core.engine_core import EngineCore
from engine.core.kv_events import event_batch, offset_endpoint_port
from engine.core.lora_request import LoRARequest
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.args import kv_events_config
from tests.engine.core.tiny_llama import save_tiny_llama


# --- vLLM's wire shapes (vllm/distributed/kv_events.py), written out here ----------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
SEED = "0"   # PYTHONHASHSEED: NONE_HASH = H("0")
SERIALIZE = {"sha256": lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
             "sha256_cbor": lambda obj: cbor2.dumps(obj, canonical=True)}


def vllm_hashes(algo: str, token_ids: list[int], block_size: int, extra: tuple[Any, ...] | None = None) -> list[int]:
    """vLLM's hash_block_tokens chain over the full blocks, each as its 64-bit int (maybe_convert_block_hash)."""
    def digest(obj: object) -> bytes:
        return hashlib.sha256(SERIALIZE[algo](obj)).digest()

    parent = digest(SEED)
    out = []
    for i in range(len(token_ids) // block_size):
        parent = digest((parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


# --- an engine publishing to a real socket ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return path


class Subscriber:
    def __init__(self, port: int, topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)

    def receive(self, timeout_ms: int = 5000) -> tuple[bytes, int, KVEventBatch]:
        assert self.sub.poll(timeout_ms), "no batch published"
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), DECODER.decode(payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def replay(port: int, start_seq: int) -> list[tuple[int, KVEventBatch]]:
    """A restarted subscriber's catch-up, as vLLM's replay protocol runs it (DEALER to the ROUTER socket)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
    got = []
    try:
        while True:
            assert sock.poll(5000), "replay did not answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture
def engine(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
           ) -> Iterator[tuple[EngineCore, Subscriber, int, str]]:
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    algo: str = request.param
    pub, rep = free_port(), free_port()
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{rep}",
                            topic="kv")
    # 6 blocks of 4 tokens: the second prompt below must evict one block of the first.
    core = EngineCore(EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=6, block_size=4,
                                   async_scheduling=False, prefix_caching_hash_algo=algo, kv_events_config=events),
                      show_progress=False)
    sub = Subscriber(pub, b"kv")
    time.sleep(0.3)   # ZMQ's slow joiner: a SUB sees only what is published after its subscription arrives
    try:
        yield core, sub, rep, algo
    finally:
        sub.close()
        core.close()


def run(core: EngineCore, request_id: str, prompt: list[int]) -> None:
    core.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()


@pytest.mark.parametrize("engine", ["sha256", "sha256_cbor"], indirect=True)
def test_a_subscriber_sees_stores_evictions_and_a_reset_then_replays_what_it_missed(
        engine: tuple[EngineCore, Subscriber, int, str]) -> None:
    core, sub, replay_port, algo = engine
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13]                  # 2 full blocks and 1 token
    second = [20 + i for i in range(17)]                     # 4 full blocks and 1 token: 5 of the 6 blocks
    a0, a1 = vllm_hashes(algo, first, 4)

    run(core, "a", first)
    topic, seq0, batch = sub.receive()
    assert (topic, seq0, batch.data_parallel_rank) == (b"kv", 0, 0)
    assert batch.events == [BlockStored(block_hashes=[a0, a1], parent_block_hash=None, token_ids=first[:8],
                                        block_size=4, lora_id=None, medium="GPU")]

    run(core, "b", second)   # "a"'s blocks wait cached; "b" needs 5: the tail of "a" (least useful) is evicted
    _, seq1, batch = sub.receive()
    assert seq1 == 1
    assert batch.events == [BlockRemoved(block_hashes=[a1], medium="GPU"),
                            BlockStored(block_hashes=vllm_hashes(algo, second, 4), parent_block_hash=None,
                                        token_ids=second[:16], block_size=4, lora_id=None, medium="GPU")]

    # A prefix hit stores only the blocks computed now, chained from the cached one.
    third = first[:4] + [40, 41, 42, 43, 44]
    run(core, "c", third)
    _, seq2, batch = sub.receive()
    assert seq2 == 2
    hashes = vllm_hashes(algo, third, 4)
    assert hashes[0] == a0
    [removed, stored] = batch.events
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 1
    assert stored == BlockStored(block_hashes=[hashes[1]], parent_block_hash=a0, token_ids=third[4:8], block_size=4,
                                 lora_id=None, medium="GPU")

    assert core.reset_prefix_cache()
    _, seq3, batch = sub.receive()
    assert seq3 == 3 and batch.events == [AllBlocksCleared()]

    # A subscriber that restarted after batch 1 asks for the rest.
    missed = replay(replay_port, 2)
    assert [seq for seq, _ in missed] == [2, 3]
    assert missed[0][1].events == [removed, stored] and missed[1][1].events == [AllBlocksCleared()]
    assert [seq for seq, _ in replay(replay_port, 0)] == [0, 1, 2, 3]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_each_hash_algo_is_vllms_serialization_and_digest(algo: str) -> None:
    import xxhash

    serialize = SERIALIZE["sha256_cbor" if algo.endswith("cbor") else "sha256"]
    digest = xxhash.xxh3_128_digest if algo.startswith("xxhash") else (lambda b: hashlib.sha256(b).digest())
    none = digest(serialize("7"))
    first = digest(serialize((none, (1, 2, 3, 4), None)))
    second = digest(serialize((first, (5, 6, 7, 8), ("sql",))))
    hasher = make_block_hasher(algo, {"PYTHONHASHSEED": "7"})
    assert hasher(None, (1, 2, 3, 4), None) == first
    assert hasher(first, (5, 6, 7, 8), ("sql",)) == second
    unseeded = make_block_hasher(algo, {})   # no PYTHONHASHSEED: a random NONE_HASH, as vLLM
    assert unseeded(None, (1, 2, 3, 4), None) != first


# --- the block manager's events ---------------------------------------------------------------------------------
def prefill(bm: BlockManager, request: Request) -> None:
    assert bm.allocate(request, request.num_tokens, bm.get_computed_blocks(request))
    request.num_computed_tokens = request.num_tokens
    bm.cache_blocks(request, request.num_tokens)


def test_lora_blocks_are_stored_with_the_adapter_and_hashed_with_its_name() -> None:
    hasher = make_block_hasher("sha256_cbor", {"PYTHONHASHSEED": SEED})
    bm = BlockManager(8, 4, hash_fn=hasher, enable_kv_cache_events=True)
    prompt = list(range(9))
    prefill(bm, Request("a", prompt, SamplingParams(max_tokens=1), lora_request=LoRARequest("sql", 7, "/sql")))
    wire = msgspec.msgpack.encode(event_batch(bm.take_events()))
    assert DECODER.decode(wire).events == [BlockStored(
        block_hashes=vllm_hashes("sha256_cbor", prompt, 4, ("sql",)), parent_block_hash=None, token_ids=prompt[:8],
        block_size=4, lora_id=7, medium="GPU", lora_name="sql")]
    assert bm.take_events() == []


def test_an_adapter_with_the_same_name_but_another_id_never_hits_the_other_ones_blocks() -> None:
    bm = BlockManager(8, 4, hash_fn=make_block_hasher("sha256", {"PYTHONHASHSEED": SEED}))
    prompt = list(range(9))
    first = Request("a", prompt, SamplingParams(max_tokens=1), lora_request=LoRARequest("sql", 1, "/a"))
    prefill(bm, first)
    other = Request("b", prompt, SamplingParams(max_tokens=1), lora_request=LoRARequest("sql", 2, "/b"))
    assert bm.get_computed_blocks(other) == []   # same hash (vLLM keys by name), but the stored key names id 1
    same = Request("c", prompt, SamplingParams(max_tokens=1), lora_request=LoRARequest("sql", 1, "/a"))
    assert bm.get_computed_blocks(same) == first.block_ids[:2]


def test_reset_is_refused_while_a_request_holds_blocks() -> None:
    bm = BlockManager(4, 4, hash_fn=make_block_hasher("sha256", {"PYTHONHASHSEED": SEED}),
                      enable_kv_cache_events=True)
    r = Request("a", list(range(9)), SamplingParams(max_tokens=1))
    prefill(bm, r)
    bm.take_events()
    assert not bm.reset_prefix_cache() and bm.take_events() == []
    bm.free(r)
    assert bm.evictable_blocks() == [1, 0]
    assert bm.reset_prefix_cache()
    assert bm.evictable_blocks() == [] and bm.num_free_blocks == 4 and bm.cached_block(r.block_hashes[0]) is None
    assert [type(e).__name__ for e in bm.take_events()] == ["AllBlocksCleared"]
    bm.check_invariants([])


def test_no_events_are_kept_when_they_are_off() -> None:
    bm = BlockManager(4, 4)
    prefill(bm, Request("a", list(range(9)), SamplingParams(max_tokens=1)))
    assert bm.take_events() == []


# --- settings ----------------------------------------------------------------------------------------------------
def test_kv_events_config_takes_vllms_keys_and_refuses_others_by_name() -> None:
    config = kv_events_config({"enable_kv_cache_events": True, "topic": "kv", "buffer_steps": 10})
    assert (config.publisher, config.endpoint, config.topic, config.buffer_steps) == ("zmq", "tcp://*:5557", "kv", 10)
    assert kv_events_config({}).publisher == "null"
    with pytest.raises(InvalidRequestError) as e:
        kv_events_config({"enable_kv_cache_events": True, "nonsense": 1})
    assert e.value.field == "--kv-events-config.nonsense"
    with pytest.raises(InvalidRequestError) as e:
        kv_events_config({"publisher": "kafka"})
    assert e.value.field == "--kv-events-config.publisher"


def test_data_parallel_replicas_offset_their_ports_as_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint_port(None, 3) is None


def test_sluice_serve_gives_each_replica_its_rank_and_the_events_settings() -> None:
    import argparse

    from engine.entrypoints.args import add_engine_args, config_from_args
    from services.child_flags import engine_flags
    from services.replicas import replica_configs

    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6000", replay_endpoint="tcp://*:6100",
                            topic="kv", buffer_steps=50)
    config = EngineConfig(kv_events_config=events, prefix_caching_hash_algo="xxhash_cbor")
    replicas = replica_configs(config, 3)
    assert [c.data_parallel_rank for c in replicas] == [0, 1, 2]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for replica in replicas:   # what each child engine reads back from its command line
        assert config_from_args(parser.parse_args(engine_flags(replica))) == replica


def test_an_endpoint_in_use_is_refused_naming_the_key() -> None:
    from engine.core.kv_events import ZmqEventPublisher

    port = free_port()
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    try:
        with pytest.raises(InvalidRequestError) as e:
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}",
                                             replay_endpoint=f"tcp://*:{port}"))
        assert e.value.field == "kv_events_config.replay_endpoint"
    finally:
        first.shutdown()
