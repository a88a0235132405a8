"""What one engine holds in its prefix cache, rebuilt from the KV events it publishes (``--kv-events-config``).

:class:`BlockIndex` is the set of block hashes (as KV events carry them: ``external_block_hash``) an engine has
cached; :class:`KVEventSubscriber` feeds it from the engine's ZMQ PUB socket (engine.core.kv_events: multipart
``[topic, seq, payload]``, msgpack ``KVEventBatch``). Batches are applied in sequence order: a subscriber that
starts, or sees a gap in the numbers, asks the replay ROUTER for what it missed; when the replay cannot cover the
gap (the engine's buffer no longer holds it), the index is rebuilt from everything the buffer still has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import msgspec
import zmq
import zmq.asyncio

from engine.core.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)


class BlockIndex:
    """The block hashes one engine has cached, as its KV events said."""

    def __init__(self) -> None:
        self._blocks: set[int] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def clear(self) -> None:
        self._blocks.clear()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()

    def matched_blocks(self, block_hashes: Iterable[int]) -> int:
        """How many of a prompt's leading blocks (chained hashes, first block first) are cached."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            n += 1
        return n


class KVEventSubscriber:
    """One engine's KV events into a :class:`BlockIndex`, on a task of the running event loop.

    ``replay_endpoint`` None: the engine replays nothing, so what was missed stays missed (said once)."""

    REPLAY_TIMEOUT_S = 2.0
    RETRY_S = 1.0

    def __init__(self, index: BlockIndex, endpoint: str, replay_endpoint: str | None, topic: str,
                 name: str) -> None:
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.name = name
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.asyncio.Context.instance()
        self._expected: int | None = None   # the next batch's seq; None: rebuild the index first
        self._task: asyncio.Task[None] | None = None
        self._warned_no_replay = False
        self.batches_applied = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    def reset(self) -> None:
        """The engine restarted (or said it cleared everything): forget its index and rebuild it."""
        self.index.clear()
        self._expected = None

    def stop(self) -> None:
        """Ends the task (its socket closes as it ends)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                if self._expected is None and self.replay_endpoint is not None:
                    await self._rebuild()
                if not await sub.poll(500):
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    logger.warning("KV events from %s: a message of %d frames, skipped", self.name, len(frames))
                    continue
                await self.receive(int.from_bytes(frames[1], "big"), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV events from %s: the subscriber failed; routing there is by load alone", self.name)
        finally:
            sub.close(linger=0)

    async def receive(self, seq: int, payload: bytes) -> None:
        """A live batch: applied when it is the next one; after a gap, the batches missed are replayed first (the
        index rebuilt when the replay cannot cover them); dropped when a replay already applied it. A batch 0 after
        later ones is a new publisher (the engine restarted): the index is rebuilt."""
        if self._expected is not None and seq == 0 and self._expected > 0:
            self._expected = None
        if self._expected is None and self.replay_endpoint is None:
            self.index.clear()
            self._expected = seq   # what was before is lost: from this batch on
        elif self._expected is None:
            await self._rebuild()
        elif seq > self._expected:
            if self.replay_endpoint is None:
                if not self._warned_no_replay:
                    self._warned_no_replay = True
                    logger.warning("KV events from %s: batches missed and the engine has no replay endpoint; its "
                                   "index may be stale", self.name)
            else:
                logger.info("KV events from %s: batches %d..%d missed; replaying them", self.name, self._expected,
                            seq - 1)
                if (not await self._replay(self._expected, must_start_at=self._expected)
                        or self._expected is None or seq > self._expected):   # None: reset meanwhile
                    await self._rebuild()
        if self._expected is not None and seq < self._expected:
            return
        self._apply(seq, payload)
        if self._expected is None:   # no replay answer: applied, and the index rebuilt with the next batch
            return
        self._expected = seq + 1

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            logger.warning("KV events from %s: batch %d does not decode (%s); skipped", self.name, seq, e)
        else:
            self.index.apply(batch)
            self.batches_applied += 1

    async def _rebuild(self) -> None:
        """The index from scratch: everything the engine's replay buffer holds."""
        self.index.clear()
        self._expected = 0
        if not await self._replay(0, must_start_at=None):
            self._expected = None   # no answer (the engine is gone or busy): tried again with the next batch
            await asyncio.sleep(self.RETRY_S)

    async def _replay(self, start: int, *, must_start_at: int | None) -> bool:
        """Apply the buffered batches from ``start`` on. False when the engine did not answer in time, or its buffer
        no longer starts at ``must_start_at`` (the batches between are lost)."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            first = True
            while True:
                if not await dealer.poll(int(self.REPLAY_TIMEOUT_S * 1000)):
                    logger.warning("KV events from %s: no replay answer within %.0f s", self.name,
                                   self.REPLAY_TIMEOUT_S)
                    return False
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or frames[1] == END_SEQ:
                    return True
                seq = int.from_bytes(frames[1], "big")
                if first and must_start_at is not None and seq != must_start_at:
                    logger.warning("KV events from %s: the replay starts at batch %d, not %d; rebuilding the index",
                                   self.name, seq, must_start_at)
                    return False
                first = False
                if self._expected is not None and seq >= self._expected:
                    self._apply(seq, frames[2])
                    self._expected = seq + 1
        finally:
            dealer.close(linger=0)
