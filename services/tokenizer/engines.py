"""One engine behind the tokenizer service, and what the service knows of it.

A service fronts one engine or several (``--engine`` repeated: the replicas of ``sluice serve -dp N``); each is
an :class:`Engine`: its stub and its ``Engine.Stream`` call, its process (``instance_id``: a new one is a restart,
which forgets our shared-memory ring and its cache), whether it is up (``server.track_engines``), the requests this
service has open there, its load as its last GetInfo said, and its prefix cache as its KV events say.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from proto.shm import ShmRing
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc
from services.tokenizer.engine_stream import EngineStream
from services.tokenizer.kv_index import BlockIndex, KVEventSubscriber
from services.tokenizer.routing import CacheView

if TYPE_CHECKING:
    from services.tokenizer.service import EngineInfo

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, channel: grpc.aio.Channel, address: str | None = None) -> None:
        """``address``: where ``channel`` goes, for the log."""
        self.channel = channel
        self.address = address
        self.name = f"the engine at {address}" if address else "the engine"
        self.stub = engine_pb2_grpc.EngineStub(channel)
        self.stream = EngineStream(self.stub)
        self.info: EngineInfo | None = None       # the servicer's view of its GetInfo; None: ask again
        self.instance_id: str | None = None       # the engine process that answered last
        self.up = False                           # connected, and it answered GetInfo on this connection
        self.shm_registered = False
        self.shm_refused = False                  # it cannot map our ring: inline ids for it
        self._shm_lock = asyncio.Lock()           # one registration at a time (requests arrive together)
        self.open_requests = 0                    # this service's requests running there now
        self.reported_load = 0                    # its running + waiting sequences, as its last GetInfo said
        self._own_at_report = 0                   # how many of those were this service's
        self.kv_cache_usage = 0.0
        self.kv_role = ""                         # its --kv-transfer-config role, as GetInfo said ("": none)
        self.kv_transport = ""                    # the KV transport it runs ("shm", "mooncake"; "": none)
        self.cache: CacheView | None = None       # its prefix cache, once it publishes KV events we follow
        self._subscriber: KVEventSubscriber | None = None

    @property
    def load(self) -> int:
        """Requests there: this service's open ones (exact, now) plus the others' as the engine's last GetInfo
        (up to a second old) counted them; this service's own requests that ended since are not counted again."""
        return self.open_requests + max(0, self.reported_load - self._own_at_report)

    @property
    def can_prefill(self) -> bool:
        """A prefill engine of disaggregated serving (``kv_producer`` or ``kv_both``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def can_decode(self) -> bool:
        """A decode engine of disaggregated serving (``kv_consumer`` or ``kv_both``)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    async def get_info(self, timeout: float | None) -> engine_pb2.GetInfoResponse:
        """Its GetInfo; a new ``instance_id`` is a restarted engine, whoever asked (see :meth:`restarted`)."""
        r: engine_pb2.GetInfoResponse = await self.stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=timeout)
        if self.instance_id is not None and r.instance_id != self.instance_id:
            self.restarted()
        self.instance_id = r.instance_id
        self.reported_load = r.num_running + r.num_waiting
        self._own_at_report = self.open_requests
        self.kv_cache_usage = r.kv_cache_usage
        self.kv_role, self.kv_transport = r.kv_role, r.kv_transport
        return r

    def restarted(self) -> None:
        """A new engine process knows neither our ring nor its info, and caches nothing yet.

        Its requests went with it; those still open here end by the call they were on. The engine stream is left
        alone: the call of an engine that is gone ended with its connection (its requests got UNAVAILABLE then),
        and the next request opens a new one. Resetting it here would kill a call already opened on the new engine,
        or one on an engine that was only slow."""
        self.shm_registered = False
        self.info = None
        if self._subscriber is not None:
            self._subscriber.reset()

    def follow_kv_events(self, r: engine_pb2.GetInfoResponse) -> None:
        """Keep :attr:`cache` from the KV events its GetInfo ``r`` names (none: no cache view, routing there is by
        load); a changed endpoint is followed anew."""
        endpoint = r.kv_events_endpoint if r.prefix_caching else ""
        algo = r.prefix_caching_hash_algo or "sha256"
        current = self._subscriber
        if current is not None and (current.endpoint, current.replay_endpoint, current.topic) == (
                endpoint, r.kv_events_replay_endpoint or None, r.kv_events_topic.encode()):
            if self.cache is not None and (self.cache.block_size, self.cache.hash_algo) != (r.block_size, algo):
                self.cache = CacheView(current.index, r.block_size, algo)
            return
        self.stop_kv_events()
        if not endpoint:
            return
        index = BlockIndex()
        self._subscriber = KVEventSubscriber(index, endpoint, r.kv_events_replay_endpoint or None,
                                             r.kv_events_topic, self.name)
        self._subscriber.start()
        self.cache = CacheView(index, r.block_size, algo)
        logger.info("following the KV events of %s at %s", self.name, endpoint)

    def stop_kv_events(self) -> None:
        if self._subscriber is not None:
            self._subscriber.stop()
        self._subscriber = None
        self.cache = None

    async def ensure_shm(self, ring: ShmRing | None, owner: str) -> bool:
        """Register ``ring`` with the engine once (again after a restart). An engine that cannot map it (on another
        host, or with a /dev/shm of its own) gets inline ids from then on, said once in the log."""
        if ring is None or self.shm_refused:
            return False
        if self.shm_registered:
            return True
        async with self._shm_lock:
            if self.shm_registered or self.shm_refused:   # another request's registration answered meanwhile
                return self.shm_registered
            try:
                r = await self.stub.RegisterSharedMemory(engine_pb2.RegisterSharedMemoryRequest(
                    segment=ring.name, size_bytes=ring.size_bytes, owner=owner), timeout=5)
            except grpc.aio.AioRpcError:
                return False
            self.shm_registered = r.ok
            if not r.ok:
                logger.warning("%s cannot map our shared memory segment %s (%s): it is on another host or sees "
                               "another /dev/shm; sending prompt ids inline from now on", self.name, ring.name,
                               r.error)
                self.shm_refused = True
        return self.shm_registered

    async def abort(self, key: str, index: int | None = None, *, kv_blocks_pulled: int | None = None) -> None:
        """Abort the engine request ``key``, or only its sequence ``index`` (its siblings go on). A late abort
        finds nothing: no later request ever has the same key. ``kv_blocks_pulled``: ``key`` is a prefill engine's
        hold whose decode engine went on having pulled this many of its blocks (the engine counts them as sent)."""
        abort = (engine_pb2.AbortRequest(request_ids=[key]) if index is None else
                 engine_pb2.AbortRequest(sequences=[engine_pb2.SequenceRef(request_id=key, index=index)]))
        if kv_blocks_pulled is not None:
            abort.kv_blocks_pulled[key] = kv_blocks_pulled
        try:
            await self.stub.Abort(abort, timeout=5)
        except grpc.aio.AioRpcError:
            logger.warning("abort of engine request %s (sequence %s) did not reach %s", key,
                           "all" if index is None else index, self.name)

    def close(self) -> None:
        self.stream.close()
        self.stop_kv_events()
