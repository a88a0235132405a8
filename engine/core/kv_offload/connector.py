"""The scheduler half of a KV offload tier (vLLM's KV connector shape: this half decides, the worker half,
``engine.worker.kv_transfer``, moves the bytes).

Store: a full block the device pool evicts (``BlockManager.on_evict``) is given a tier slot under its hash (LRU,
within the tier's slots) and copied there at the start of the step, before its device block is reused.

Load: a waiting request whose device prefix hit stops short is looked up block by block in the tier. When the
following blocks are there, the request gets its device hit plus fresh blocks for them and leaves the waiting queue
while the worker copies them in (a disk tier reads on its I/O thread while other requests' steps run). When the
worker reports the job, the blocks that arrived intact are registered in the device prefix cache and the request
goes back to the head of the queue without its blocks: its admission then finds them as an ordinary prefix hit
(so they count in ``cached_tokens`` and the prefix cache hit counters). A block that failed (a corrupted entry) is
dropped from the tier and it and those after it are recomputed. A request is looked up in the tier once per
admission, so a block evicted again before the request is seated is recomputed rather than loaded in a loop.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.config import KVOffloadConfig
from engine.core.block_hashing import external_block_hash
from engine.core.block_manager import BlockManager, block_extra_keys
from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.core.kv_offload.tier_index import BlockHash, BlockKey, TierIndex
from engine.core.request import Request, SequenceId
from engine.worker.kv_transfer import BlockRef, KVTransfer, LoadJob

# KV events' medium of each backend: vLLM's CPU offloading names its medium "CPU".
TIER_MEDIUM = {"native": "CPU", "disk": "DISK"}

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def hash_bytes(block_hash: BlockHash) -> bytes:
    """A block hash as the worker keeps it (a test's integer hashes as 16 bytes)."""
    return block_hash if isinstance(block_hash, bytes) else int(block_hash).to_bytes(16, "big", signed=True)


@dataclass
class _Load:
    request: Request
    num_device_blocks: int        # the device prefix hit the load extends
    hashes: list[BlockHash]       # of the blocks loaded, in order
    refs: list[BlockRef]


class OffloadConnector:
    """One engine's offload tier, seen from the scheduler: the index of what it holds, the step's transfers, the
    requests whose blocks are being loaded, and the tier's counters and KV events."""

    def __init__(self, config: KVOffloadConfig, block_manager: BlockManager, num_slots: int, *,
                 requeue: Callable[[Request], None], enable_events: bool = False) -> None:
        """``requeue``: puts a request whose load ended back in the waiting queue (at its head)."""
        self.config = config
        self.block_manager = block_manager
        self.index = TierIndex(num_slots)
        self.medium = TIER_MEDIUM[config.backend]
        self._requeue = requeue
        self._events: list[KVEvent] | None = [] if enable_events else None
        self._stores: list[BlockRef] = []
        self._new_loads: list[LoadJob] = []
        self._cancelled: list[int] = []
        self._loads: dict[int, _Load] = {}
        self._job_of: dict[SequenceId, int] = {}
        self._next_job = 0
        self._looked_up: set[SequenceId] = set()   # loaded for their coming admission: not looked up again
        self.queries = 0   # prompt tokens of the requests looked up in the tier (vLLM's external_prefix_cache)
        self.hits = 0      # of those, tokens loaded from it
        self.num_stored = 0
        block_manager.on_evict = self._on_evict

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def is_loading(self, request: Request) -> bool:
        return request.seq_id in self._job_of

    # ----- store -----------------------------------------------------------------------------------------

    def _on_evict(self, block_id: int, block_hash: BlockHash, key: BlockKey) -> None:
        """The device pool evicts a cached block: keep it in the tier (unless it is there already)."""
        if self.index.touch(block_hash):
            return
        put = self.index.put(block_hash, key)
        if put is None:   # every slot is being loaded from
            return
        slot, evicted = put
        if evicted is not None:   # a store of this step into the same slot is superseded
            self._stores = [ref for ref in self._stores if ref[1] != slot]
        if evicted is not None and self._events is not None:
            self._events.append(BlockRemoved(block_hashes=[external_block_hash(evicted)], medium=self.medium))
        self._stores.append((block_id, slot, hash_bytes(block_hash)))
        self.num_stored += 1
        if self._events is not None:
            parent, tokens, extra, lora_id = key
            self._events.append(BlockStored(
                block_hashes=[external_block_hash(block_hash)],
                parent_block_hash=None if parent is None else external_block_hash(parent),
                token_ids=list(tokens), block_size=len(tokens), lora_id=lora_id, medium=self.medium,
                lora_name=None if lora_id is None or not extra else extra[0]))

    # ----- load ------------------------------------------------------------------------------------------

    def start_load(self, unit: list[Request]) -> bool:
        """Start loading the tier's blocks that extend a waiting unit's device prefix hit. True: the request now
        holds blocks and waits for them (the caller takes it out of the waiting queue); False: admit it as usual."""
        if len(unit) != 1:   # beams are admitted together: not loaded
            return False
        request = unit[0]
        if request.seq_id in self._looked_up:
            self._looked_up.discard(request.seq_id)
            return False
        bm = self.block_manager
        if request.needs_prompt_logprobs or request.block_ids or not bm.enable_prefix_caching:
            return False
        computed = bm.get_computed_blocks(request)
        bs = bm.block_size
        first, max_blocks = len(computed), (request.num_tokens - 1) // bs
        if first >= max_blocks:
            return False
        self.queries += request.num_tokens
        hashes = request.block_hashes
        tokens = request.all_token_ids
        lora_id = request.lora_id
        slots: list[int] = []
        for i in range(first, max_blocks):
            key = (hashes[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs].tolist()),
                   block_extra_keys(request, i, bs), lora_id)
            slot = self.index.lookup(hashes[i], key)
            if slot is None:
                break
            slots.append(slot)
        if not slots:
            return False
        for slot in slots:   # before allocating: the evictions it causes store into the tier
            self.index.pin(slot)
        if not bm.allocate(request, len(slots) * bs, computed, count=False):
            for slot in slots:
                self.index.unpin(slot)
            return False
        loaded = hashes[first:first + len(slots)]
        for block_hash in loaded:
            self.index.touch(block_hash)
        job_id = self._next_job
        self._next_job += 1
        refs = [(request.block_ids[first + j], slot, hash_bytes(h)) for j, (slot, h) in enumerate(zip(slots, loaded))]
        self._loads[job_id] = _Load(request, first, list(loaded), refs)
        self._job_of[request.seq_id] = job_id
        self._new_loads.append(LoadJob(job_id, refs))
        return True

    def finish_loads(self, loaded: Mapping[int, int]) -> None:
        """The worker's report of the jobs that ended: ``{job id: blocks that arrived intact}``."""
        bm = self.block_manager
        for job_id, num_good in loaded.items():
            load = self._loads.pop(job_id, None)
            if load is None:   # cancelled after the worker had taken it
                continue
            request = load.request
            del self._job_of[request.seq_id]
            for _, slot, _ in load.refs:
                self.index.unpin(slot)
            if num_good < len(load.refs):   # a torn or corrupted entry: never served again
                self._drop(load.hashes[num_good])
            bm.cache_blocks(request, (load.num_device_blocks + num_good) * bm.block_size)
            bm.free(request)
            self.hits += num_good * bm.block_size
            self._looked_up.add(request.seq_id)
            self._requeue(request)

    def cancel(self, request: Request) -> bool:
        """A loading request ends (aborted): its job is cancelled (the caller frees its blocks). False when it
        was not loading."""
        job_id = self._job_of.pop(request.seq_id, None)
        if job_id is None:
            self._looked_up.discard(request.seq_id)
            return False
        load = self._loads.pop(job_id)
        for _, slot, _ in load.refs:
            self.index.unpin(slot)
        self._cancelled.append(job_id)
        self._new_loads = [job for job in self._new_loads if job.job_id != job_id]
        return True

    def _drop(self, block_hash: BlockHash) -> None:
        if self.index.drop(block_hash) and self._events is not None:
            self._events.append(BlockRemoved(block_hashes=[external_block_hash(block_hash)], medium=self.medium))

    # ----- per step --------------------------------------------------------------------------------------

    def take_transfer(self, idle: bool) -> KVTransfer | None:
        """The step's transfer (None: nothing to move and no load in flight). ``idle``: the step runs nothing
        else, so the worker may wait a little for a load."""
        if not (self._stores or self._new_loads or self._cancelled or self._loads):
            return None
        transfer = KVTransfer(self._stores, self._new_loads, self._cancelled, idle=idle)
        self._stores, self._new_loads, self._cancelled = [], [], []
        return transfer

    def take_events(self) -> list[KVEvent]:
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """The prefix cache was reset (no request holds blocks, so none is loading): forget the tier too."""
        self.index.clear()
        self._looked_up.clear()
