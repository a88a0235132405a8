"""BlockManager: exact block ids, refcounts, verified prefix hits, LRU eviction, copy-on-write."""

from __future__ import annotations

import pytest

from engine.core.block_hashing import make_block_hasher
from engine.core.block_manager import BlockManager
from engine.core.lora_request import LoRARequest
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], index: int = 0, lora_id: int | None = None) -> Request:
    lora = None if lora_id is None else LoRARequest(f"adapter{lora_id}", lora_id, f"/adapters/{lora_id}")
    return Request(request_id, tokens, SamplingParams(max_tokens=4), index=index, lora_request=lora)


def run_prefill(bm: BlockManager, request: Request, computed_blocks: list[int] | None = None) -> None:
    """Allocate the whole sequence (after a prefix hit, if any), mark it computed and cache its full blocks."""
    computed = computed_blocks or []
    num_cached = len(computed) * bm.block_size
    assert bm.allocate(request, request.num_tokens - num_cached, computed)
    request.num_computed_tokens = request.num_tokens
    bm.cache_blocks(request, request.num_computed_tokens)


def test_allocation_and_free_order_exact_ids() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    r1, r2 = make_request("r1", list(range(10))), make_request("r2", list(range(5)))
    assert bm.allocate(r1, 10) and r1.block_ids == [0, 1, 2]
    assert bm.allocate(r2, 5) and r2.block_ids == [3, 4]
    assert bm.num_free_blocks == 3 and bm.usage() == pytest.approx(5 / 8)
    assert [bm.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.check_invariants([r1, r2])
    bm.free(r1)
    assert r1.block_ids == [] and bm.num_free_blocks == 6
    # Freed blocks join the back of the free list, tail first.
    r3 = make_request("r3", list(range(16)))
    assert bm.allocate(r3, 16) and r3.block_ids == [5, 6, 7, 2]
    bm.check_invariants([r2, r3])
    bm.free(r2)
    bm.free(r3)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
    bm.check_invariants([])


def test_allocate_grows_one_block_at_a_boundary_and_refuses_atomically() -> None:
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    r = make_request("r", [1, 2, 3, 4])
    assert bm.allocate(r, 4) and r.block_ids == [0]
    r.num_computed_tokens = 4
    r.append_output_token(5)
    assert bm.allocate(r, 1) and r.block_ids == [0, 1]
    big = make_request("big", list(range(9)))   # needs 3 blocks, 1 is free
    assert not bm.can_allocate(big, 9)
    assert not bm.allocate(big, 9)
    assert big.block_ids == [] and bm.num_free_blocks == 1
    bm.check_invariants([r])


hash_block_tokens = make_block_hasher("sha256", {"PYTHONHASHSEED": "0"})


def test_prefix_hit_shares_full_blocks_and_counts_tokens() -> None:
    bm = BlockManager(8, 4, hash_fn=hash_block_tokens)
    r1 = make_request("r1", list(range(10)))
    assert bm.get_computed_blocks(r1) == []
    run_prefill(bm, r1)
    assert r1.block_ids == [0, 1, 2]
    # Only the two full blocks are cached, under chained hashes.
    h0 = hash_block_tokens(None, (0, 1, 2, 3))
    h1 = hash_block_tokens(h0, (4, 5, 6, 7))
    assert r1.block_hashes == [h0, h1]
    assert bm.cached_block(h0) == 0 and bm.cached_block(h1) == 1

    r2 = make_request("r2", list(range(8)) + [100, 101, 102])
    hit = bm.get_computed_blocks(r2)
    assert hit == [0, 1]
    assert bm.ref_count(0) == 1   # a lookup claims nothing
    run_prefill(bm, r2, hit)
    assert r2.block_ids == [0, 1, 3]
    assert [bm.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    bm.check_invariants([r1, r2])
    bm.free(r1)
    bm.free(r2)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_blocks_are_keyed_by_the_lora_adapter_name_and_base_blocks_have_no_extra_keys() -> None:
    bm = BlockManager(16, 4, hash_fn=hash_block_tokens)
    prompt = list(range(9))   # two full blocks
    base = make_request("base", prompt)
    a, b = make_request("a", prompt, lora_id=1), make_request("b", prompt, lora_id=2)
    for r in (base, a, b):
        assert bm.get_computed_blocks(r) == []   # the same tokens under another adapter (or none) never hit
        run_prefill(bm, r)
    assert (base.block_ids, a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5], [6, 7, 8])
    h0 = hash_block_tokens(None, (0, 1, 2, 3))
    assert base.block_hashes == [h0, hash_block_tokens(h0, (4, 5, 6, 7))]   # no extra keys: unchanged
    a0 = hash_block_tokens(None, (0, 1, 2, 3), ("adapter1",))   # vLLM's extra key: the adapter's name
    assert a.block_hashes == [a0, hash_block_tokens(a0, (4, 5, 6, 7), ("adapter1",))]
    assert len({*base.block_hashes, *a.block_hashes, *b.block_hashes}) == 6
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (27, 0)
    # Each hits its own blocks on a repeat, and only those.
    for lora_id, blocks in ((None, [0, 1]), (1, [3, 4]), (2, [6, 7]), (3, [])):
        again = make_request("again", prompt + [50], lora_id=lora_id)
        hit = bm.get_computed_blocks(again)
        assert hit == blocks, lora_id
        run_prefill(bm, again, hit)
        bm.free(again)
    assert bm.prefix_cache_hits == 3 * 8
    bm.check_invariants([base, a, b])


def test_a_block_whose_hash_collides_across_adapters_is_verified_by_its_adapter() -> None:
    # This hash ignores the extra keys: adapter 1's blocks and base blocks of the same tokens collide.
    bm = BlockManager(8, 4, hash_fn=lambda parent, tokens, extra: hash((parent, tokens)))
    a = make_request("a", list(range(9)), lora_id=1)
    run_prefill(bm, a)
    base = make_request("base", list(range(9)))
    assert bm.get_computed_blocks(base) == [] and base.block_hashes[0] == a.block_hashes[0]
    assert bm.get_computed_blocks(make_request("a2", list(range(9)), lora_id=1)) == [0, 1]
    bm.check_invariants([a])


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    run_prefill(bm, make_request("r1", list(range(12))))
    # Exactly the two cached blocks: serving both would leave nothing to compute, so one is served.
    assert bm.get_computed_blocks(make_request("same8", list(range(8)))) == [0]
    assert bm.get_computed_blocks(make_request("nine", list(range(9)))) == [0, 1]
    assert bm.get_computed_blocks(make_request("one", [0])) == []


def test_forged_hash_collision_is_never_served() -> None:
    # This hash ignores a block's last token, so [1,2,3,4] and [1,2,3,9] collide.
    bm = BlockManager(8, 4, hash_fn=lambda parent, tokens, extra: hash((parent, tokens[:-1], extra)))
    r1 = make_request("r1", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    run_prefill(bm, r1)
    impostor = make_request("imp", [1, 2, 3, 9, 5, 6, 7, 8, 0])
    assert impostor.block_hashes == [] and bm.get_computed_blocks(impostor) == []
    assert impostor.block_hashes[0] == r1.block_hashes[0]   # the hashes did collide
    run_prefill(bm, impostor)
    assert impostor.block_ids == [3, 4, 5]
    # The impostor's block is not registered over the real one.
    assert bm.cached_block(r1.block_hashes[0]) == 0
    genuine = make_request("gen", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.get_computed_blocks(genuine) == [0, 1]
    bm.check_invariants([r1, impostor])


def test_lru_eviction_order_and_revival() -> None:
    bm = BlockManager(4, 2)
    r1, r2 = make_request("r1", [1, 2, 3, 4]), make_request("r2", [5, 6, 7, 8])
    run_prefill(bm, r1)
    run_prefill(bm, r2)
    assert (r1.block_ids, r2.block_ids) == ([0, 1], [2, 3])
    bm.free(r1)
    bm.free(r2)
    # Cached blocks wait, each sequence's tail first (a tail is useless without its head).
    assert bm.evictable_blocks() == [1, 0, 3, 2]
    assert bm.num_free_blocks == 4

    r3 = make_request("r3", [9, 9])
    run_prefill(bm, r3)
    assert r3.block_ids == [1]   # evicted the least recently freed block, and unregistered it
    assert bm.evictable_blocks() == [0, 3, 2]
    assert bm.cached_block(r1.block_hashes[1]) is None
    assert bm.get_computed_blocks(make_request("q", [1, 2, 3, 4, 0])) == [0]

    r4 = make_request("r4", [5, 6, 7, 8, 10])
    hit = bm.get_computed_blocks(r4)
    assert hit == [2, 3]
    run_prefill(bm, r4, hit)
    # Both hits revived from the LRU list; the new block had to evict block 0.
    assert r4.block_ids == [2, 3, 0]
    assert bm.evictable_blocks() == [] and bm.num_free_blocks == 0
    assert bm.cached_block(r1.block_hashes[0]) is None
    bm.check_invariants([r3, r4])


def test_can_allocate_counts_revived_blocks() -> None:
    bm = BlockManager(3, 2)
    r1 = make_request("r1", [1, 2, 3, 4])
    run_prefill(bm, r1)
    bm.free(r1)
    assert bm.evictable_blocks() == [1, 0] and bm.num_free_blocks == 3
    # 7 tokens = 4 blocks: 2 cached + 2 new, but reviving the 2 cached leaves only 1 free.
    long = make_request("long", [1, 2, 3, 4, 5, 6, 7])
    hit = bm.get_computed_blocks(long)
    assert hit == [0, 1]
    assert not bm.can_allocate(long, 3, hit)
    assert not bm.allocate(long, 3, hit) and long.block_ids == [] and bm.evictable_blocks() == [1, 0]
    short = make_request("short", [1, 2, 3, 4, 5])
    assert bm.allocate(short, 1, bm.get_computed_blocks(short))
    assert short.block_ids == [0, 1, 2]
    bm.check_invariants([short])


def test_fork_shares_blocks_and_copies_on_write() -> None:
    bm = BlockManager(8, 4)
    parent = make_request("p", [1, 2, 3, 4, 5, 6])
    run_prefill(bm, parent)
    child = make_request("p", [1, 2, 3, 4, 5, 6], index=1)
    bm.fork(parent, child)
    assert child.block_ids == [0, 1] and child.block_hashes == parent.block_hashes
    assert child.num_seen_blocks == parent.num_seen_blocks == 1
    assert (bm.ref_count(0), bm.ref_count(1)) == (2, 2)
    bm.check_invariants([parent, child])

    for r, token in ((parent, 7), (child, 8)):
        r.num_computed_tokens = 6
        r.append_output_token(token)
    # The parent writes position 6, inside the shared, partly filled block 1: it gets a copy.
    assert bm.allocate(parent, 1)
    assert parent.block_ids == [0, 2] and bm.pop_block_copies() == [(1, 2)]
    assert bm.pop_block_copies() == []
    # Now the child alone holds block 1 and writes in place.
    assert bm.allocate(child, 1)
    assert child.block_ids == [0, 1] and bm.pop_block_copies() == []
    assert [bm.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    bm.check_invariants([parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_fork_at_block_boundary_needs_no_copy_and_cow_needs_a_free_block() -> None:
    bm = BlockManager(3, 4)
    parent = make_request("p", list(range(8)))
    run_prefill(bm, parent)
    child = make_request("c", list(range(8)))
    bm.fork(parent, child)
    child.append_output_token(9)
    child.num_computed_tokens = 8
    assert bm.allocate(child, 1) and child.block_ids == [0, 1, 2] and bm.pop_block_copies() == []

    bm2 = BlockManager(2, 4)
    p2 = make_request("p2", [1, 2, 3, 4, 5, 6])
    run_prefill(bm2, p2)
    c2 = make_request("c2", [1, 2, 3, 4, 5, 6])
    bm2.fork(p2, c2)
    p2.append_output_token(7)
    assert not bm2.can_allocate(p2, 1)   # the copy needs a block and none is free
    bm2.free(c2)
    assert bm2.allocate(p2, 1) and p2.block_ids == [0, 1] and bm2.pop_block_copies() == []


def test_check_invariants_catches_a_missing_holder() -> None:
    bm = BlockManager(4, 4)
    r = make_request("r", [1, 2, 3])
    assert bm.allocate(r, 3)
    with pytest.raises(AssertionError, match="total 4"):
        bm.check_invariants([])
    twice = make_request("t", [1])
    twice.block_ids = [0, 0]
    with pytest.raises(AssertionError, match="twice"):
        bm.check_invariants([twice])
