"""The scheduler half of prefill/decode disaggregation (``--kv-transfer-config``; vLLM's KV connector shape: this
half decides and keeps the books, the worker half, ``engine.worker.kv_pull``, moves the bytes through a transport).

Producer: a request with ``do_remote_decode`` runs its prompt and samples its first token as any request does (the
core caps it at one token). When that token does not end it, the request ends *holding* its blocks: its last output
names the prompt's full blocks (``RemoteKV``), which stay allocated — and in the prefix cache, unevictable — until
its request id is aborted (the tokenizer service does so once the decode engine has gone on) or
``hold_timeout_s`` passes.

Consumer: a waiting request that names a producer's blocks is looked up once, at admission, as a KV offload tier's
is: its device prefix hit first (a prefix cached here is never transferred), then the producer's blocks that follow,
as long as their hashes equal this engine's own for the same tokens (another model, block size, adapter, salt or
image never passes). Fresh blocks are allocated and the request leaves the queue while the worker reads into them;
when it reports, the blocks that arrived are registered in the prefix cache and the request goes back to the head
of the queue without blocks, where admission finds them as an ordinary prefix hit. Whatever did not arrive (a
transfer that failed, timed out, or was refused) is computed here: a fallback, counted.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.kv_offload.connector import hash_bytes
from engine.core.kv_transfer_params import RemoteKV
from engine.core.request import Request, SequenceId
from engine.kv_transfer_config import KVTransferConfig
from engine.worker.kv_transfer import KVTransfer, LoadJob, RemoteSource
from engine.worker.kv_transports import KVSource

logger = logging.getLogger(__name__)

# A consumer stops reading this long before the producer's hold ends (the message took some time to arrive).
_HOLD_MARGIN_S = 1.0


def transfer_hash_environ(config: EngineConfig) -> Mapping[str, str] | None:
    """The environment the prefix cache's root hash is taken from (``engine.core.block_hashing.none_hash``): the
    engines of a disaggregated deployment must hash alike, so without ``PYTHONHASHSEED`` (which must then be the
    same on all of them) they share a fixed seed instead of a random one per process. None: the process's own."""
    if config.kv_transfer_config is None or "PYTHONHASHSEED" in os.environ:
        return None
    return {"PYTHONHASHSEED": "sluice-kv-transfer"}


@dataclass
class _Hold:
    request: Request
    num_blocks: int   # the prompt's full blocks offered
    deadline: float


@dataclass
class _Pull:
    request: Request
    num_device_blocks: int   # the device prefix hit the pull extends
    num_blocks: int          # blocks asked of the producer
    started: float


@dataclass
class TransferCounters:
    """What crossed, for the engine's metrics: blocks and bytes by direction, fallbacks to recompute, and each
    finished pull's seconds (drained by the metrics collector)."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    fallbacks: int = 0
    holds_expired: int = 0
    latencies: list[float] = field(default_factory=list)


class DisaggConnector:
    """One engine's side of disaggregation, seen from the scheduler."""

    def __init__(self, config: KVTransferConfig, block_manager: BlockManager, *, block_bytes: int,
                 source: KVSource | None, requeue: Callable[[Request], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``block_bytes``: one block in every layer (the byte counters); ``source``: where consumers reach this
        engine's cache (a producer's; None for a consumer only); ``requeue``: puts a request whose pull ended back
        at the head of the waiting queue."""
        self.config = config
        self.block_manager = block_manager
        self.block_bytes = block_bytes
        self.source = source
        self._requeue = requeue
        self._clock = clock
        self._holds: dict[str, _Hold] = {}
        self._pulls: dict[int, _Pull] = {}
        self._job_of: dict[SequenceId, int] = {}
        self._new_loads: list[LoadJob] = []
        self._cancelled: list[int] = []
        self._next_job = 0
        self.counters = TransferCounters()
        self.queries = 0   # prompt tokens of the requests that named a producer's blocks (vLLM's external cache)
        self.hits = 0      # of those, tokens pulled

    @property
    def num_loading(self) -> int:
        return len(self._pulls)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.request.block_ids) for h in self._holds.values())

    def is_loading(self, request: Request) -> bool:
        return request.seq_id in self._job_of

    # ----- producer ------------------------------------------------------------------------------------

    def hold(self, request: Request) -> RemoteKV:
        """``request`` (a do_remote_decode request whose first token did not end it) ends now: keep its blocks for
        a consumer (the caller does not free them) and return what its last output says of them."""
        assert self.source is not None, "a consumer-only engine is never asked to hold blocks"
        bs = self.block_manager.block_size
        num_full = min(request.num_prompt_tokens // bs, len(request.block_hashes), len(request.block_ids))
        self._holds[request.request_id] = _Hold(request, num_full, self._clock() + self.config.hold_timeout_s)
        return RemoteKV(remote_engine_id=self.source.engine_id, transport=self.source.transport,
                        remote_address=self.source.address,
                        remote_block_ids=tuple(request.block_ids[:num_full]),
                        block_hashes=tuple(hash_bytes(h) for h in request.block_hashes[:num_full]),
                        hold_s=self.config.hold_timeout_s, layout=self.source.layout)

    def release(self, request_id: str, num_pulled: int = 0) -> bool:
        """The request's consumer has gone on having pulled ``num_pulled`` of its blocks (counted as sent), or it
        was aborted: its blocks go back to the pool. False when it holds none."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False
        self.block_manager.free(hold.request)
        sent = max(0, min(num_pulled, hold.num_blocks))
        self.counters.blocks_sent += sent
        self.counters.bytes_sent += sent * self.block_bytes
        return True

    def expire(self) -> int:
        """Lets go of the holds past their timeout (their consumer never came); returns how many."""
        now = self._clock()
        late = [rid for rid, hold in self._holds.items() if hold.deadline <= now]
        for rid in late:
            hold = self._holds.pop(rid)
            self.block_manager.free(hold.request)
            self.counters.holds_expired += 1
            logger.warning("KV transfer: request %s's %d blocks were held %.0f s for a decode engine that did not "
                           "take them; they are freed", rid, hold.num_blocks, self.config.hold_timeout_s)
        return len(late)

    # ----- consumer ------------------------------------------------------------------------------------

    def start_load(self, unit: list[Request]) -> bool:
        """Start pulling the producer's blocks that extend a waiting request's device prefix hit. True: the request
        now holds blocks and waits for them (the caller takes it out of the waiting queue); False: admit it as
        usual (nothing to pull, or the pull was refused: then it is computed here)."""
        if len(unit) != 1:
            return False
        request = unit[0]
        remote = request.kv_transfer
        if remote is None or not remote.has_source:
            return False
        request.kv_transfer = None   # looked up once: a request back in the queue is admitted as it is
        bm = self.block_manager
        computed = bm.get_computed_blocks(request)
        bs = bm.block_size
        first = len(computed)
        last = min(len(remote.remote_block_ids), len(remote.block_hashes), (request.num_tokens - 1) // bs)
        self.queries += request.num_tokens
        if first >= last:
            return False   # everything it could pull is cached here already
        why = self._refusal(remote)
        own = request.block_hashes
        end = first
        while why is None and end < last and hash_bytes(own[end]) == remote.block_hashes[end]:
            end += 1
        if why is None and end == first:
            why = "the prompt's block hashes differ from the producer's (another model, block size, hash " \
                  "algorithm, adapter, salt or image)"
        if why is not None:
            self.counters.fallbacks += 1
            logger.warning("KV transfer: request %s computes its prompt here: %s", request.request_id, why)
            return False
        if not bm.allocate(request, (end - first) * bs, computed, count=False):
            return False   # no room now: computed here when it is admitted (not a transfer's failure)
        now = self._clock()
        deadline = now + min(self.config.transfer_timeout_s, max(0.0, remote.hold_s - _HOLD_MARGIN_S))
        job_id = self._next_job
        self._next_job += 1
        refs = [(request.block_ids[i], remote.remote_block_ids[i], remote.block_hashes[i]) for i in range(first, end)]
        self._pulls[job_id] = _Pull(request, first, end - first, now)
        self._job_of[request.seq_id] = job_id
        self._new_loads.append(LoadJob(job_id, refs, RemoteSource(remote.transport, remote.remote_address,
                                                                  remote.layout, deadline)))
        return True

    def _refusal(self, remote: RemoteKV) -> str | None:
        if not self.config.is_consumer:
            return f"this engine's kv_role is {self.config.kv_role}"
        if remote.transport != self.config.transport:
            return f"the blocks are on the {remote.transport!r} transport, this engine runs {self.config.transport!r}"
        return None

    def finish_loads(self, loaded: Mapping[int, int]) -> None:
        """The worker's report of the pulls that ended: ``{job id: blocks that arrived intact}``."""
        bm = self.block_manager
        now = self._clock()
        for job_id, num_good in loaded.items():
            pull = self._pulls.pop(job_id, None)
            if pull is None:   # cancelled after the worker had taken it
                continue
            request = pull.request
            del self._job_of[request.seq_id]
            bm.cache_blocks(request, (pull.num_device_blocks + num_good) * bm.block_size)
            bm.free(request)
            self.hits += num_good * bm.block_size
            request.kv_blocks_received = num_good
            self.counters.blocks_received += num_good
            self.counters.bytes_received += num_good * self.block_bytes
            self.counters.latencies.append(now - pull.started)
            if num_good < pull.num_blocks:
                self.counters.fallbacks += 1
                logger.warning("KV transfer: request %s got %d of its %d blocks from the producer; the rest is "
                               "computed here", request.request_id, num_good, pull.num_blocks)
            self._requeue(request)

    def cancel(self, request: Request) -> bool:
        """A pulling request ends (aborted): its pull is cancelled (the caller frees its blocks). False when it was
        not pulling."""
        job_id = self._job_of.pop(request.seq_id, None)
        if job_id is None:
            return False
        del self._pulls[job_id]
        self._cancelled.append(job_id)
        self._new_loads = [job for job in self._new_loads if job.job_id != job_id]
        return True

    def take_transfer(self, idle: bool) -> KVTransfer | None:
        """The step's transfer (None: nothing new and no pull in flight)."""
        if not (self._new_loads or self._cancelled or self._pulls):
            return None
        transfer = KVTransfer([], self._new_loads, self._cancelled, idle=idle)
        self._new_loads, self._cancelled = [], []
        return transfer
