"""What an offload tier holds: the scheduler's index of its slots, LRU within a fixed number of them."""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any

# The prefix cache's block hash and the key a hit is verified against (engine.core.block_manager's types).
BlockHash = Any
BlockKey = tuple[Any, tuple[int, ...], Any, int | None]


class TierIndex:
    """``num_slots`` slots, each holding one block under its hash. ``put`` takes a free slot, else the least
    recently used one that no load has pinned; a slot never holds two blocks, so the tier never outgrows
    ``num_slots`` blocks (the byte budget, ``engine.worker.kv_transfer.tier_slots``). A hit is verified against
    the block's key (parent hash, tokens, extra keys, LoRA id) as the device cache verifies its own."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()   # front = least recently used
        self._key_of_slot: list[BlockKey | None] = [None] * num_slots
        self._hash_of_slot: list[BlockHash | None] = [None] * num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._pins: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def hashes(self) -> list[BlockHash]:
        """The blocks held, least recently used first."""
        return list(self._slot_of)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._slot_of.get(block_hash)

    def lookup(self, block_hash: BlockHash, key: BlockKey) -> int | None:
        """The slot holding ``block_hash`` when its key is ``key`` (a hash collision is a miss); changes nothing."""
        slot = self._slot_of.get(block_hash)
        if slot is None or self._key_of_slot[slot] != key:
            return None
        return slot

    def touch(self, block_hash: BlockHash) -> bool:
        """Mark a held block most recently used; False when it is not held."""
        if block_hash not in self._slot_of:
            return False
        self._slot_of.move_to_end(block_hash)
        return True

    def put(self, block_hash: BlockHash, key: BlockKey) -> tuple[int, BlockHash | None] | None:
        """A slot for a new block and the hash it evicted (None: a free slot); None when every slot is pinned."""
        if block_hash in self._slot_of:
            raise ValueError("the block is already held")
        evicted: BlockHash | None = None
        if self._free:
            slot = self._free.popleft()
        else:
            victim = next((h for h, s in self._slot_of.items() if not self._pins[s]), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            evicted = victim
        self._slot_of[block_hash] = slot
        self._key_of_slot[slot] = key
        self._hash_of_slot[slot] = block_hash
        return slot, evicted

    def pin(self, slot: int) -> None:
        """A load reads ``slot``: it is not reused until ``unpin``."""
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]

    def drop(self, block_hash: BlockHash) -> bool:
        """Forget a block (its entry failed a load); False when it is not held."""
        slot = self._slot_of.pop(block_hash, None)
        if slot is None:
            return False
        self._key_of_slot[slot] = None
        self._hash_of_slot[slot] = None
        self._free.append(slot)
        return True

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset); only when no load is in flight."""
        if self._pins:
            raise ValueError("a load is in flight")
        for block_hash in list(self._slot_of):
            self.drop(block_hash)
