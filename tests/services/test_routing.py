"""Routing across engines (services.tokenizer.routing) and the per-engine block index its KV events feed
(services.tokenizer.kv_index). The index is built from the events of the engine's own block manager, and a
prompt's match is checked against that block manager's own prefix lookup; the subscriber reads a real publisher
(engine.core.kv_events) over ZMQ, with a gap it must replay."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec
import pytest

from common.procs import free_port
from engine.config import KVEventsConfig
from engine.core.block_hashing import make_block_hasher
from engine.core.block_manager import BlockManager
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    event_batch,
)
from engine.core.lora_request import LoRARequest
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from services.tokenizer.kv_index import BlockIndex, KVEventSubscriber
from services.tokenizer.routing import CacheView, Router, RoutingSettings

SEED = {"PYTHONHASHSEED": "1234"}
BS = 4


def hasher_for(algo: str) -> object:
    return make_block_hasher(algo, SEED)


@dataclass
class FakeEngine:
    """What the router reads of an engine."""

    cache: CacheView | None
    load: int = 0
    kv_cache_usage: float = 0.0


def engine_with(*prompts: list[int], num_blocks: int = 64, algo: str = "sha256",
                lora: LoRARequest | None = None) -> tuple[BlockManager, BlockIndex]:
    """A block manager that computed ``prompts`` (and freed them: cached, evictable), and an index built from
    nothing but its KV events."""
    bm = BlockManager(num_blocks, BS, hash_fn=make_block_hasher(algo, SEED), enable_kv_cache_events=True)
    for i, prompt in enumerate(prompts):
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=1), lora_request=lora)
        assert bm.allocate(r, r.num_tokens, bm.get_computed_blocks(r))
        r.num_computed_tokens = r.num_tokens
        bm.cache_blocks(r, r.num_tokens)
        bm.free(r)
    index = BlockIndex()
    index.apply(roundtrip(event_batch(bm.take_events())))
    return bm, index


def roundtrip(batch: KVEventBatch) -> KVEventBatch:
    return msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(batch))


def router(**settings: object) -> Router:
    return Router(RoutingSettings(**settings), hasher_for)   # type: ignore[arg-type]


def cached_by_engine(bm: BlockManager, prompt: list[int], lora: LoRARequest | None = None) -> int:
    """Prompt tokens the block manager itself would serve from its cache (every full block: the router counts
    those; the engine keeps the last token back, so a whole-prompt hit is one block less there)."""
    probe = Request("probe", prompt + [0], SamplingParams(max_tokens=1), lora_request=lora)
    return len(bm.get_computed_blocks(probe)) * BS


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_the_router_matches_what_the_engines_block_manager_has_cached(algo: str) -> None:
    shared = list(range(100, 112))   # three blocks
    bm, index = engine_with(shared + [1, 2, 3, 4, 5], shared[:8] + [7, 7, 7, 7], algo=algo)
    view = CacheView(index, BS, algo)
    for prompt in (shared + [9] * 6, shared[:8] + [7, 7, 7, 7, 1], shared[:5], [5] * 12, shared + [1, 2, 3, 4, 5]):
        decision = router().choose([FakeEngine(view), FakeEngine(None)], prompt)
        assert decision.matched_tokens == cached_by_engine(bm, prompt), (prompt, decision)
        if decision.matched_tokens:
            assert (decision.choice, decision.policy) == (0, "kv_aware")
    assert [cached_by_engine(bm, p) for p in (shared + [9] * 6, shared[:8] + [7, 7, 7, 7, 1], [5] * 12)] == [12, 12, 0]
    unseeded = Router(RoutingSettings(), lambda algo: make_block_hasher(algo, {}))   # another NONE_HASH: no match
    assert unseeded.choose([FakeEngine(view), FakeEngine(None)], shared).matched_tokens == 0


def test_a_lora_prompt_matches_only_its_adapters_blocks_and_a_salt_only_its_own() -> None:
    sql = LoRARequest("sql", 1, "/sql")
    prompt = list(range(12))
    bm, index = engine_with(prompt, lora=sql)
    view = CacheView(index, BS, "sha256")
    engines = [FakeEngine(view), FakeEngine(None)]
    assert router().choose(engines, prompt, lora_name="sql").matched_tokens == 12 == cached_by_engine(bm, prompt, sql)
    assert router().choose(engines, prompt).matched_tokens == 0 == cached_by_engine(bm, prompt)
    assert router().choose(engines, prompt, lora_name="sql", cache_salt="s").matched_tokens == 0


def test_the_index_follows_stored_removed_and_cleared_events() -> None:
    index = BlockIndex()
    index.apply(event_batch([BlockStored([1, 2, 3], None, list(range(12)), 4, None, "GPU")]))
    assert index.matched_blocks([1, 2, 3, 4]) == 3
    index.apply(event_batch([BlockRemoved([2], "GPU")]))
    assert index.matched_blocks([1, 2, 3]) == 1 and 3 in index   # a chain breaks at its first missing block
    index.apply(event_batch([BlockStored([2], 1, list(range(4, 8)), 4, None, "GPU"), AllBlocksCleared()]))
    assert len(index) == 0


def test_an_evicted_block_is_removed_from_the_index() -> None:
    bm, index = engine_with(list(range(8)), num_blocks=3)   # two cached blocks, one free
    view = CacheView(index, BS, "sha256")
    r = Request("big", list(range(50, 62)), SamplingParams(max_tokens=1))   # 3 blocks: evicts both
    assert bm.allocate(r, r.num_tokens, [])
    index.apply(event_batch(bm.take_events()))
    assert len(index) == 0
    assert router().choose([FakeEngine(view), FakeEngine(None)], list(range(8))).matched_tokens == 0


def test_the_longest_cached_prefix_wins_and_ties_go_by_load_then_in_turn() -> None:
    prompt = list(range(20))
    _, short = engine_with(prompt[:8])
    _, long = engine_with(prompt[:16])
    engines = [FakeEngine(CacheView(short, BS, "sha256"), load=0), FakeEngine(CacheView(long, BS, "sha256"), load=2)]
    assert router().choose(engines, prompt).choice == 1
    assert router().choose(engines, prompt).matched_tokens == 16
    idle = [FakeEngine(None), FakeEngine(None), FakeEngine(None, load=1)]
    r = router()
    assert sorted(r.choose(idle, prompt).choice for _ in range(4)) == [0, 0, 1, 1]   # alternating, never the busy one


def test_a_hot_prefix_under_concurrency_spreads_once_loads_drift_apart() -> None:
    prompt = list(range(32))
    _, index = engine_with(prompt)
    hot, cold = FakeEngine(CacheView(index, BS, "sha256")), FakeEngine(CacheView(BlockIndex(), BS, "sha256"))
    r = router(balance_abs_threshold=4, balance_rel_threshold=1.5)
    chosen = []
    for _ in range(12):   # none finishes: each request adds to its engine's load
        engine = [hot, cold][r.choose([hot, cold], prompt).choice]
        engine.load += 1
        chosen.append(engine is hot)
    assert chosen[:5] == [True] * 5   # the cache wins while the imbalance is small
    assert 3 <= chosen.count(False) <= 6, chosen
    only_cache = router(balance_abs_threshold=1000)
    assert {only_cache.choose([FakeEngine(hot.cache, load=50), cold], prompt).choice for _ in range(3)} == {0}


def test_round_robin_and_least_loaded_ignore_the_cache() -> None:
    prompt = list(range(16))
    _, index = engine_with(prompt)
    engines = [FakeEngine(CacheView(index, BS, "sha256"), load=3), FakeEngine(None, load=1)]
    assert [router(policy="round_robin").choose(engines, prompt).choice for _ in range(1)] in ([0], [1])
    rr = router(policy="round_robin")
    assert sorted(rr.choose(engines, prompt).choice for _ in range(4)) == [0, 0, 1, 1]
    assert {router(policy="least_loaded").choose(engines, prompt).choice for _ in range(3)} == {1}
    with pytest.raises(ValueError):
        RoutingSettings(policy="random")


# --- the subscriber, against the engine's own publisher ----------------------------------------------------------
def stored(*hashes: int) -> KVEventBatch:
    return event_batch([BlockStored(list(hashes), None, [0] * 4 * len(hashes), 4, None, "GPU")])


async def until(check: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():   # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def publisher(topic: str = "kv") -> tuple[ZmqEventPublisher, str, str]:
    pub, rep = free_port(), free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub}",
                            replay_endpoint=f"tcp://*:{rep}", topic=topic)
    return ZmqEventPublisher(config), f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"


def test_the_subscriber_rebuilds_from_replay_replays_a_gap_and_follows_live_batches() -> None:
    async def main() -> None:
        events, endpoint, replay = publisher()
        encode = msgspec.msgpack.Encoder().encode
        try:
            for batch in (stored(1, 2), event_batch([BlockRemoved([2], "GPU")]), stored(3)):   # seq 0, 1, 2
                events.publish(batch)
            time.sleep(0.2)
            index = BlockIndex()
            sub = KVEventSubscriber(index, endpoint, replay, "kv", "engine")
            # Joining late: the first batch seen (whichever) rebuilds the index from the replay buffer.
            await sub.receive(2, encode(stored(3)))
            assert [h for h in range(1, 9) if h in index] == [1, 3]
            # Batches 3 and 4 published but not seen live: batch 4 arrives, 3 is missing, both are replayed.
            events.publish(stored(4))
            events.publish(stored(5))
            time.sleep(0.2)
            await sub.receive(4, encode(stored(5)))
            assert [h for h in range(1, 9) if h in index] == [1, 3, 4, 5]
            # A gap the buffer no longer covers (5 and 6 never published): rebuilt from the buffer, then applied.
            await sub.receive(7, encode(stored(8)))
            assert [h for h in range(1, 9) if h in index] == [1, 3, 4, 5, 8]
            await sub.receive(7, encode(stored(6)))   # already applied: dropped
            assert 6 not in index
            sub.reset()   # the engine restarted: known empty until its replay says otherwise
            assert len(index) == 0
            # Live, over the PUB socket, filtered by topic.
            sub = KVEventSubscriber(index, endpoint, replay, "kv", "engine")
            sub.start()
            await until(lambda: 5 in index)   # its start rebuilt the index from the replay
            await asyncio.sleep(0.3)   # the subscription reaches the publisher
            events.publish(stored(20))
            await until(lambda: 20 in index)
            assert sub.batches_applied >= 6
            sub.stop()
        finally:
            events.shutdown()

    asyncio.run(main())
