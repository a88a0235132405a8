"""KV cache events as vLLM publishes them (``--kv-events-config``): the engine's view of its prefix cache for
routers.

Each engine step whose block manager registered, evicted or cleared cached blocks publishes one
``KVEventBatch`` (msgpack, vLLM's msgspec structs: an event is an array tagged with its class name, defaults
omitted). On the PUB socket a batch is the multipart message ``[topic, seq, payload]``, ``seq`` an 8-byte
big-endian counter starting at 0. A subscriber that missed batches sends ``[b"", start_seq]`` (8 bytes big-endian)
from a DEALER socket to the replay ROUTER socket and gets back ``[b"", seq, payload]`` for every buffered batch
from ``start_seq`` on, then ``[b"", -1 (8 bytes, signed), b""]``. Data-parallel replica ``r`` binds each endpoint's
port + ``r`` and stamps ``data_parallel_rank`` on its batches.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec

from common.errors import InvalidRequestError
from engine.config import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"   # vLLM's medium name for the device KV cache (Sluice's, whatever the device)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks registered in the prefix cache: ``block_hashes`` chain from ``parent_block_hash`` (None: from
    the start of a sequence); ``token_ids`` are theirs, concatenated."""

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


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel replica ``data_parallel_rank``: a tcp port + rank, an inproc name + ``_dp{r}``
    (vLLM's ``ZmqEventPublisher.offset_endpoint_port``), and an ipc path + ``_dp{r}`` as well (vLLM refuses ipc
    there; ``sluice serve`` uses it to keep the events off the network)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint or endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid KV events endpoint {endpoint!r}: must be tcp://, ipc:// or inproc://")


class NullEventPublisher:
    """KV events off (the default), or ``publisher: "null"``."""

    def publish(self, batch: KVEventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher:
    """A PUB socket and an optional replay ROUTER socket, served by one thread; the last ``buffer_steps`` batches
    are kept for replay. ``publish`` only queues (the engine step never waits on the network)."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        assert self.endpoint is not None
        key = "endpoint"
        try:
            # vLLM's convention: a wildcard, ipc or inproc address is bound (stable side), any other is connected.
            if "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                key = "replay_endpoint"
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            address = self.endpoint if key == "endpoint" else self.replay_endpoint
            raise InvalidRequestError(f"kv_events_config.{key}", f"cannot open {address}: {e}") from e
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kv-events-publisher")
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:   # a stuck publisher must not stall the engine: the subscriber sees a seq gap
            logger.warning("KV events queue full (%d batches): a batch is dropped", self._queue.maxsize)

    def shutdown(self) -> None:
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except Exception:
                    logger.exception("KV events replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            seq = next(seqs)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                logger.exception("KV events: publishing batch %d failed", seq)
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


EventPublisher = NullEventPublisher | ZmqEventPublisher


def make_event_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)


def event_batch(events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=events)
