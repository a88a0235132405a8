"""The offload tier's parts alone: the scheduler's index (LRU, pins, budget), the disk entries and their checks, the
worker's copies, and the connector's decisions over a real block manager."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.config import KVOffloadConfig
from engine.core.block_manager import BlockManager
from engine.core.kv_events import BlockRemoved, BlockStored
from engine.core.kv_offload import OffloadConnector, TierIndex
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.worker.kv_transfer import (
    DISK_ENTRY_OVERHEAD,
    DiskTier,
    KVTransfer,
    KVTransferWorker,
    LoadJob,
    cache_block_bytes,
    tier_slots,
)


def key(tokens: tuple[int, ...]) -> tuple[None, tuple[int, ...], None, None]:
    return (None, tokens, None, None)


# ----- the index ---------------------------------------------------------------------------------------------------
def test_the_index_evicts_the_least_recently_used_unpinned_block() -> None:
    index = TierIndex(3)
    assert [index.put(h, key((h,))) for h in (10, 11, 12)] == [(0, None), (1, None), (2, None)]
    assert index.touch(10)                       # 11 is now the least recently used
    assert index.put(13, key((13,))) == (1, 11)
    assert index.hashes() == [12, 10, 13]
    index.pin(index.slot_of(12) or 0)            # a load reads 12: the next victim is 10
    assert index.put(14, key((14,))) == (0, 10)
    assert len(index) == 3 and 10 not in index and 11 not in index


def test_a_full_index_of_pinned_slots_takes_nothing() -> None:
    index = TierIndex(2)
    for h in (1, 2):
        slot = index.put(h, key((h,)))
        assert slot is not None
        index.pin(slot[0])
    assert index.put(3, key((3,))) is None
    index.unpin(index.slot_of(1) or 0)
    assert index.put(3, key((3,))) == (index.slot_of(3), 1)


def test_a_hit_is_verified_against_the_key_and_a_dropped_slot_is_reused() -> None:
    index = TierIndex(1)
    index.put(7, key((1, 2)))
    assert index.lookup(7, key((1, 2))) == 0
    assert index.lookup(7, key((1, 3))) is None   # a hash collision is a miss
    assert index.drop(7) and not index.drop(7)
    assert index.put(8, key((5,))) == (0, None)


def test_tier_slots_count_the_disk_header() -> None:
    assert tier_slots(10 * 2048, 2048, "native") == 10
    assert tier_slots(10 * 2048, 2048, "disk") == 10 * 2048 // (2048 + DISK_ENTRY_OVERHEAD)


# ----- disk entries ------------------------------------------------------------------------------------------------
BLOCK_SHAPE = (2, 2, 4, 2, 8)   # layers, K/V, tokens, heads, head_dim


def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "tier", BLOCK_SHAPE, torch.float32)


def test_a_disk_entry_round_trips(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    block = torch.randn(BLOCK_SHAPE)
    tier.submit_store(3, b"h" * 32, block)
    got = tier.submit_load(3, b"h" * 32).result()
    assert got is not None and torch.equal(got, block)
    assert tier.path(3).stat().st_size <= block.numel() * 4 + DISK_ENTRY_OVERHEAD
    tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_hash", "empty"])
def test_a_damaged_or_foreign_entry_is_refused_and_removed(tmp_path: Path, damage: str) -> None:
    tier = disk(tmp_path)
    tier.submit_store(0, b"a" * 32, torch.randn(BLOCK_SHAPE))
    tier.submit_load(0, b"a" * 32).result()   # written
    path = tier.path(0)
    data = bytearray(path.read_bytes())
    wanted = b"a" * 32
    if damage == "flip":
        data[-100] ^= 0x01
    elif damage == "truncate":   # a torn write
        del data[len(data) // 2:]
    elif damage == "empty":
        data = bytearray()
    else:
        wanted = b"b" * 32      # the slot holds another block
    path.write_bytes(bytes(data))
    assert tier.submit_load(0, wanted).result() is None
    assert not path.exists()
    tier.close()


def test_a_new_disk_tier_forgets_a_previous_process_entries(tmp_path: Path) -> None:
    tier = disk(tmp_path)
    tier.submit_store(0, b"a" * 32, torch.randn(BLOCK_SHAPE))
    tier.close()
    assert disk(tmp_path).submit_load(0, b"a" * 32).result() is None


# ----- the worker's copies -----------------------------------------------------------------------------------------
def caches(num_blocks: int = 6) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, 4, 2, 8) for _ in range(2)]


@pytest.mark.parametrize("backend", ["native", "disk"])
def test_the_worker_stores_blocks_and_copies_them_back_into_other_blocks(tmp_path: Path, backend: str) -> None:
    kv = caches()
    size = 4 * (cache_block_bytes(kv) + (DISK_ENTRY_OVERHEAD if backend == "disk" else 0))
    worker = KVTransferWorker(kv, size_bytes=size, backend=backend, path=str(tmp_path), pin=False)
    assert worker.num_slots == 4
    before = [c[:, [1, 2]].clone() for c in kv]
    assert worker.execute(KVTransfer(stores=[(1, 0, b"x"), (2, 3, b"y")])) == {}
    for c in kv:
        c[:, [1, 2]] = 0   # the device blocks are reused
    job = LoadJob(5, [(4, 0, b"x"), (5, 3, b"y")])
    done = worker.execute(KVTransfer(loads=[job], idle=True))
    deadline = time.monotonic() + 5
    while not done:   # disk: lands in a later step
        assert time.monotonic() < deadline
        done = worker.execute(KVTransfer(idle=True))
    assert done == {5: 2}
    for c, b in zip(kv, before):
        assert torch.equal(c[:, [4, 5]], b)
    worker.close()


def test_a_load_of_a_slot_that_holds_another_block_stops_there() -> None:
    kv = caches()
    worker = KVTransferWorker(kv, size_bytes=4 * cache_block_bytes(kv), backend="native", path=None, pin=False)
    worker.execute(KVTransfer(stores=[(1, 0, b"x"), (2, 1, b"y")]))
    assert worker.execute(KVTransfer(loads=[LoadJob(0, [(3, 0, b"x"), (4, 1, b"z"), (5, 0, b"x")])])) == {0: 1}


def test_a_cancelled_disk_load_is_never_copied_in(tmp_path: Path) -> None:
    kv = caches()
    worker = KVTransferWorker(kv, size_bytes=4 * (cache_block_bytes(kv) + DISK_ENTRY_OVERHEAD), backend="disk",
                              path=str(tmp_path), pin=False)
    worker.execute(KVTransfer(stores=[(1, 0, b"x")]))
    assert worker.execute(KVTransfer(loads=[LoadJob(1, [(3, 0, b"x")])])) in ({}, {1: 1})
    kept = [c[:, 3].clone() for c in kv]
    worker.disk._io.submit(lambda: None).result() if worker.disk else None   # noqa: SLF001 - the read is done
    assert worker.execute(KVTransfer(cancelled=[1])) == {}
    assert all(torch.equal(c[:, 3], k) for c, k in zip(kv, kept))
    worker.close()


# ----- the connector over a block manager --------------------------------------------------------------------------
BS = 4


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


def computed(bm: BlockManager, r: Request) -> None:
    """Admit ``r`` with its whole prompt computed and registered, then end it (its blocks stay cached)."""
    assert bm.allocate(r, r.num_tokens, bm.get_computed_blocks(r))
    bm.cache_blocks(r, r.num_tokens)
    bm.free(r)


def connector(num_blocks: int, num_slots: int) -> tuple[BlockManager, OffloadConnector, list[Request]]:
    bm = BlockManager(num_blocks, BS, hash_fn=lambda parent, tokens, extra: hash((parent, tokens, extra)))
    requeued: list[Request] = []
    conn = OffloadConnector(KVOffloadConfig(size_gib=1.0), bm, num_slots, requeue=requeued.append,
                            enable_events=True)
    return bm, conn, requeued


def test_evicted_blocks_are_stored_and_a_returning_prompt_loads_them() -> None:
    bm, conn, requeued = connector(num_blocks=4, num_slots=8)
    a = list(range(1, 14))    # 13 tokens: 3 full blocks
    computed(bm, request("a", a))
    computed(bm, request("b", list(range(50, 63))))   # evicts a's three cached blocks (LRU)
    transfer = conn.take_transfer(idle=False)
    assert transfer is not None and len(transfer.stores) == 3
    events = conn.take_events()
    assert [type(e) for e in events] == [BlockStored] * 3
    assert {e.medium for e in events if isinstance(e, BlockStored)} == {"CPU"}
    assert {tuple(e.token_ids) for e in events if isinstance(e, BlockStored)} == {
        tuple(a[0:4]), tuple(a[4:8]), tuple(a[8:12])}
    back = request("a2", a)
    assert conn.start_load([back])
    assert conn.num_loading == 1 and conn.is_loading(back) and len(back.block_ids) == 3
    transfer = conn.take_transfer(idle=True)
    assert transfer is not None and len(transfer.loads) == 1
    job = transfer.loads[0]
    assert [ref[0] for ref in job.blocks] == back.block_ids
    conn.finish_loads({job.job_id: 3})
    assert requeued == [back] and back.block_ids == [] and conn.hits == 3 * BS
    assert len(bm.get_computed_blocks(back)) == 3   # now an ordinary device prefix hit
    assert not conn.start_load([back])              # looked up once per admission
    bm.check_invariants([])


def test_a_failed_block_is_dropped_and_only_the_blocks_before_it_are_cached() -> None:
    bm, conn, _ = connector(num_blocks=4, num_slots=8)
    a = list(range(1, 14))
    computed(bm, request("a", a))
    computed(bm, request("b", list(range(50, 63))))
    conn.take_transfer(idle=False)
    conn.take_events()
    back = request("a2", a)
    assert conn.start_load([back])
    transfer = conn.take_transfer(idle=True)
    assert transfer is not None
    conn.finish_loads({transfer.loads[0].job_id: 1})
    assert len(bm.get_computed_blocks(back)) == 1
    hashes = back.block_hashes
    assert hashes[0] in conn.index and hashes[1] not in conn.index and hashes[2] in conn.index
    last = conn.take_events()[-1]
    assert isinstance(last, BlockRemoved) and last.block_hashes == [hashes[1]] and last.medium == "CPU"


def test_an_aborted_load_is_cancelled_and_unpins_its_slots() -> None:
    bm, conn, requeued = connector(num_blocks=4, num_slots=3)
    a = list(range(1, 14))
    computed(bm, request("a", a))
    computed(bm, request("b", list(range(50, 63))))
    conn.take_transfer(idle=False)
    back = request("a2", a)
    assert conn.start_load([back])
    transfer = conn.take_transfer(idle=True)
    assert transfer is not None
    assert conn.cancel(back) and not conn.is_loading(back)
    bm.free(back)
    after = conn.take_transfer(idle=True)
    assert after is not None and after.cancelled == [transfer.loads[0].job_id]
    conn.finish_loads({transfer.loads[0].job_id: 3})   # the worker's late report is ignored
    assert requeued == []
    for h in (1001, 1002, 1003):                       # every slot may be reused again
        assert conn.index.put(h, key((h,))) is not None
    bm.check_invariants([])


def test_the_tier_stores_within_its_slots_and_reports_what_it_evicts() -> None:
    bm, conn, _ = connector(num_blocks=4, num_slots=2)
    for i in range(4):
        computed(bm, request(f"r{i}", [100 * i + t for t in range(1, 14)]))
        assert len(conn.index) <= 2
    events = conn.take_events()
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    assert stored - removed == len(conn.index) == 2 and removed > 0
