"""Paged KV blocks: a fixed pool with reference counts, verified prefix caching and copy-on-write.

A block holds the KV of ``block_size`` consecutive tokens. A request's block
table (``request.block_ids``) maps its token positions to blocks; the block
manager is the only writer of that table.

Prefix caching: every FULL block of a request gets a chained hash
``H((parent_hash, block_tokens, extra_keys))`` (``engine.core.block_hashing``, vLLM's function; kept on
``request.block_hashes``). Once its KV is computed the block is registered under
that hash; a later request whose prefix has the same hash chain reuses it, after
comparing the stored key (parent hash, tokens, extra keys) so that a hash
collision can never serve wrong KV. The extra keys name the request's LoRA
adapter (its ``lora_name``, as vLLM hashes it; the stored key adds its
``lora_id``): KV computed through one adapter's weights is never served to
another adapter or to the base model, whose blocks have no extra keys. The
first block's also carry the request's ``cache_salt`` (vLLM's), so the chain
of a salted prompt is shared only by requests with the same salt.
With KV events on, registering, evicting and clearing blocks record vLLM's
BlockStored / BlockRemoved / AllBlocksCleared (``take_events``). A freed block that is registered is not
wiped: it waits on an LRU list and is only reused (and unregistered) when no
plain free block is left.

Copy-on-write: ``fork`` gives a child the parent's table with every refcount
raised. A request about to write into a block it shares (the partly filled last
block after a fork) gets a private block instead, and the (src, dst) copy is
queued for the runner to perform before the forward pass.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engine.core.block_hashing import ExtraKeys, external_block_hash, make_block_hasher, mm_block_hashes
from engine.core.block_hashing import block_extra_keys as hashing_extra_keys
from engine.core.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from engine.core.request import Request

BlockHash = bytes | int   # bytes from engine.core.block_hashing; a test may hash to ints
# What a cached block is verified against on a hit: (parent hash, its tokens, extra keys, LoRA adapter id).
BlockKey = tuple[BlockHash | None, tuple[int, ...], ExtraKeys, int | None]
HashFn = Callable[[Any, tuple[int, ...], ExtraKeys], Any]
KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def block_extra_keys(request: Request, index: int, block_size: int) -> ExtraKeys:
    """What besides its tokens block ``index`` of ``request``'s KV depends on, as vLLM hashes it: the LoRA adapter's
    name, the hashes of the images whose placeholders it covers, and on the first block the request's cache salt
    (None for an unsalted text-only base-model block)."""
    lora = request.lora_request
    mm = (mm_block_hashes([(it.offset, it.length, it.hash) for it in request.mm_items], index * block_size,
                          (index + 1) * block_size) if request.mm_items else ())
    return hashing_extra_keys(None if lora is None else lora.lora_name, request.cache_salt, index == 0, mm)


# A table entry whose block was given back: outside every layer's sliding window, never read again.
RELEASED = -1


class BlockManager:
    """A pool of ``num_blocks`` KV blocks shared by all requests.

    Call pattern of the scheduler: ``get_computed_blocks`` (lookup, changes
    nothing) → ``can_allocate`` / ``allocate`` (claims cached blocks and new
    ones atomically) → after the step ``cache_blocks`` → ``free`` when done.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 hash_fn: HashFn | None = None, enable_kv_cache_events: bool = False) -> None:
        """``hash_fn``: None is ``make_block_hasher("sha256")``. ``enable_kv_cache_events``: record the
        prefix cache's changes for ``take_events``."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn: HashFn = hash_fn if hash_fn is not None else make_block_hasher()
        self._events: list[KVEvent] | None = [] if enable_kv_cache_events else None
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))        # refcount 0, holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, cached; front = least recent
        self._hash_of_block: list[BlockHash | None] = [None] * num_blocks
        self._key_of_block: list[BlockKey | None] = [None] * num_blocks
        self._block_of_hash: dict[BlockHash, int] = {}
        self._copies: list[tuple[int, int]] = []
        # Called with (block id, hash, key) as a cached block is evicted, before it is reused (a KV offload tier).
        self.on_evict: Callable[[int, BlockHash, BlockKey], None] | None = None
        self.prefix_cache_queries = 0   # tokens looked up, counted when a request is first given blocks
        self.prefix_cache_hits = 0      # of those, tokens served from the cache

    # ----- stats -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request could get now: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def usage(self) -> float:
        """Fraction of the pool held by requests (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def evictable_blocks(self) -> list[int]:
        """Cached free blocks, least recently freed (next to be evicted) first."""
        return list(self._evictable)

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self._block_of_hash.get(block_hash)

    # ----- prefix cache ------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks that hold a prefix of ``request`` (it must hold no blocks yet).

        A lookup only: nothing is claimed until ``allocate(request, n, computed_blocks)``.
        ``len(result) * block_size`` tokens are served; the hit stops one token
        short of the whole sequence because a request must compute at least one
        token to get logits.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        tokens = request.all_token_ids
        bs = self.block_size
        lora_id = request.lora_id
        blocks: list[int] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            block_id = self._block_of_hash.get(hashes[i])
            if (block_id is None or self._key_of_block[block_id] != (
                    parent, tuple(tokens[i * bs:(i + 1) * bs].tolist()), block_extra_keys(request, i, bs), lora_id)):
                break
            blocks.append(block_id)
            parent = hashes[i]
        return blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks of ``request`` that are full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        # Blocks looked at by an earlier call are skipped: O(new blocks) per step.
        start = request.num_seen_blocks
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        tokens = request.all_token_ids
        bs = self.block_size
        lora_id = request.lora_id
        stored: list[int] = []   # the table indices registered now, for BlockStored
        for i in range(start, num_full):
            block_id = request.block_ids[i]
            # Already registered (a prefix hit, or shared by a fork), or the same content is cached in
            # another block (two requests computed it at once; or a true collision): leave it plain.
            if self._hash_of_block[block_id] is not None or hashes[i] in self._block_of_hash:
                continue
            parent = hashes[i - 1] if i > 0 else None
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs].tolist())
            self._hash_of_block[block_id] = hashes[i]
            self._key_of_block[block_id] = (parent, block_tokens, block_extra_keys(request, i, bs), lora_id)
            self._block_of_hash[hashes[i]] = block_id
            stored.append(i)
        request.num_seen_blocks = num_full
        if self._events is not None and stored:
            self._record_stored(request, hashes, stored)

    def _record_stored(self, request: Request, hashes: list[Any], stored: list[int]) -> None:
        """One BlockStored per run of consecutive table indices in ``stored`` (each run is one hash chain)."""
        assert self._events is not None
        tokens, bs = request.all_token_ids, self.block_size
        lora = request.lora_request
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self._events.append(BlockStored(
                block_hashes=[external_block_hash(hashes[i]) for i in run],
                parent_block_hash=external_block_hash(hashes[first - 1]) if first > 0 else None,
                token_ids=tokens[first * bs:(last + 1) * bs].tolist(), block_size=bs,
                lora_id=None if lora is None else lora.lora_int_id, medium=MEDIUM_GPU,
                lora_name=None if lora is None else lora.lora_name))

    def _block_hashes(self, request: Request, num_blocks: int) -> list[Any]:
        """request.block_hashes, extended to cover its first ``num_blocks`` (full) blocks."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(self._hash_fn(hashes[-1] if hashes else None, tuple(tokens[i * bs:(i + 1) * bs].tolist()),
                                        block_extra_keys(request, i, bs)))
        return hashes

    # ----- allocation --------------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]) -> tuple[int, list[int]]:
        """(number of fresh blocks needed, table indices that need copy-on-write)."""
        if computed_blocks and (request.block_ids or request.num_computed_tokens):
            raise ValueError(f"{request.seq_id}: computed blocks are only for a request holding none")
        num_computed = len(computed_blocks) * self.block_size if computed_blocks else request.num_computed_tokens
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_fresh = max(0, num_needed - len(request.block_ids) - len(computed_blocks))
        # Blocks written this step that someone else also holds: only the partly filled last block after a fork.
        first_written = num_computed // self.block_size
        cow = [i for i in range(first_written, min(num_needed, len(request.block_ids)))
               if self._ref_counts[request.block_ids[i]] > 1]
        return num_fresh, cow

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate`` with the same arguments would succeed. Changes nothing."""
        num_fresh, cow = self._plan(request, num_new_tokens, computed_blocks)
        # Claiming a cached block that sits on the evictable list uses up one of the free ones.
        num_revived = sum(1 for b in computed_blocks if self._ref_counts[b] == 0)
        return num_fresh + len(cow) + num_revived <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (), *,
                 count: bool = True) -> bool:
        """Give ``request`` blocks for ``num_computed + num_new_tokens`` tokens; False (nothing changed) if short.

        ``num_computed`` is ``len(computed_blocks) * block_size`` when cached
        blocks from ``get_computed_blocks`` are passed (the request then holds
        none), else ``request.num_computed_tokens``. The caller sets
        ``request.num_computed_tokens`` to the cached count after success.
        ``count`` False leaves the prefix cache counters alone (an offload tier's load: the request is counted when
        it is admitted after it).
        """
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        num_fresh, cow = self._plan(request, num_new_tokens, computed_blocks)
        if count and not request.block_ids and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            self._claim(block_id)
        if computed_blocks:
            request.block_ids.extend(computed_blocks)
            request.num_seen_blocks = len(computed_blocks)
        for i in cow:
            src = request.block_ids[i]
            dst = self._pop_free_block()
            self._ref_counts[src] -= 1   # was > 1: the other holders keep it
            self._ref_counts[dst] = 1
            request.block_ids[i] = dst
            self._copies.append((src, dst))
        for _ in range(num_fresh):
            block_id = self._pop_free_block()
            self._ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def _claim(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]   # a hit revives an evictable block
        self._ref_counts[block_id] += 1

    def _pop_free_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block_id, _ = self._evictable.popitem(last=False)   # evict the least recently freed cached block
        block_hash = self._hash_of_block[block_id]
        assert block_hash is not None
        if self.on_evict is not None:
            key = self._key_of_block[block_id]
            assert key is not None
            self.on_evict(block_id, block_hash, key)
        del self._block_of_hash[block_hash]
        self._hash_of_block[block_id] = None
        self._key_of_block[block_id] = None
        if self._events is not None:
            self._events.append(BlockRemoved(block_hashes=[external_block_hash(block_hash)], medium=MEDIUM_GPU))
        return block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); only when no request holds a block, else
        False and nothing changes. Records AllBlocksCleared."""
        if len(self._free) + len(self._evictable) != self.num_blocks:
            return False
        for block_id in self._evictable:
            self._hash_of_block[block_id] = None
            self._key_of_block[block_id] = None
            self._free.append(block_id)
        self._evictable.clear()
        self._block_of_hash.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call (none when events are off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks and clear its table.

        The table is walked from its end so a sequence's tail is evicted before
        its head (a cached tail is useless without the head before it).
        """
        for block_id in reversed(request.block_ids):
            if block_id != RELEASED:
                self._release(block_id)
        request.block_ids = []
        request.num_seen_blocks = 0

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks of ``request``'s table past its first ``num_tokens`` tokens: the lookahead slots
        of proposed tokens that were rejected (speculative decoding). Those blocks hold no computed token, so
        none is registered in the prefix cache."""
        keep = -(-num_tokens // self.block_size)
        while len(request.block_ids) > keep:
            self._release(request.block_ids.pop())

    def release_outside_window(self, request: Request, window: int) -> int:
        """Give back the blocks of ``request`` that no future query reads: every layer attends over its last
        ``window`` positions, and the next query sits at ``num_computed_tokens``, so a block whose last position is
        below ``num_computed_tokens - window + 1`` is done with. Its table entry becomes ``RELEASED`` (the windowed
        attention never gathers it); a cached block waits on the LRU list for a prefix hit, as any freed one.
        Returns how many blocks were given back.

        The entries given back always form a prefix of the table (each call gives back all of them below
        ``done``), so the walk goes back from ``done`` to the first one already given back: a step costs the blocks
        it frees, not the context (32 sequences of 8k tokens: 0.6 ms a step when it walked from the start)."""
        done = (request.num_computed_tokens - window + 1) // self.block_size
        count = 0
        ids = request.block_ids
        i = min(done, len(ids)) - 1
        while i >= 0 and ids[i] != RELEASED:
            self._release(ids[i])
            ids[i] = RELEASED
            count += 1
            i -= 1
        return count

    def _release(self, block_id: int) -> None:
        """Drop one hold on a block; unheld, it waits on the LRU list when registered, else it is plain free."""
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if self._hash_of_block[block_id] is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks (shared, refcount + 1); the first write to a shared block copies it."""
        if child.block_ids:
            raise ValueError(f"{child.seq_id} already holds blocks")
        for block_id in parent.block_ids:
            if block_id != RELEASED:
                self._ref_counts[block_id] += 1
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_seen_blocks = parent.num_seen_blocks

    def pop_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies recorded since the last call; the runner does them before the forward pass.

        A src block may be freed and handed to another request in the same
        step, which is safe only because the copies run before anything writes.
        """
        copies, self._copies = self._copies, []
        return copies

    # ----- test support --------------------------------------------------------------

    def check_invariants(self, holders: Iterable[Request]) -> None:
        """Raise AssertionError unless the pool is consistent with the block tables of ``holders``.

        ``holders`` must be every request that holds blocks.
        """
        held: Counter[int] = Counter()
        for request in holders:
            ids = [b for b in request.block_ids if b != RELEASED]
            if len(set(ids)) != len(ids):
                raise AssertionError(f"{request.seq_id} holds a block twice: {request.block_ids}")
            held.update(ids)
        free, evictable = list(self._free), list(self._evictable)
        if len(set(free)) != len(free) or set(free) & set(evictable):
            raise AssertionError(f"a block is listed twice: free={free} evictable={evictable}")
        if set(free) & held.keys() or set(evictable) & held.keys():
            raise AssertionError("a held block is also on a free list")
        if len(free) + len(evictable) + len(held) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + evictable {len(evictable)} + held {len(held)} "
                                 f"!= total {self.num_blocks}")
        for block_id in range(self.num_blocks):
            if self._ref_counts[block_id] != held[block_id]:
                raise AssertionError(f"block {block_id}: refcount {self._ref_counts[block_id]} "
                                     f"but held by {held[block_id]} tables")
        if any(self._hash_of_block[b] is not None for b in free):
            raise AssertionError("a plain free block still carries a hash")
        if any(self._hash_of_block[b] is None for b in evictable):
            raise AssertionError("an evictable block carries no hash")
        registered = {b: h for b, h in enumerate(self._hash_of_block) if h is not None}
        if {h: b for b, h in registered.items()} != self._block_of_hash or len(registered) != len(self._block_of_hash):
            raise AssertionError("hash map and per-block hashes disagree")
