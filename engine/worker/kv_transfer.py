"""The worker half of a KV offload tier: copies whole blocks' keys and values out of the device cache into the tier
and back (the scheduler half, ``engine.core.kv_offload``, decides which, and keeps the tier's index).

A tier is a fixed number of *slots*, each holding one block of every layer this rank caches (its shard's KV heads):
``native`` keeps them in one host tensor (pinned where the device is an accelerator), ``disk`` in one file per slot
under ``{path}/sluice-kv-dp{dp}-rank{rank}/``. Each step's :class:`KVTransfer` runs before anything writes to the
cache, in this order: cancelled loads are dropped, evicted blocks are stored (their device blocks are about to be
reused), loads are started, and the loads whose data is here are copied into their device blocks. A disk load reads
its files on the tier's I/O thread while the model runs, and lands in a later step. The result of a step is, for
each load job that ended, how many of its blocks (a prefix) arrived intact; the scheduler recomputes the rest.

A disk entry is ``b"SLKV" | u32 header length | JSON header | payload | xxh3-128 of header + payload``; the header
names the block's hash, the payload's shape and dtype. An entry whose digest, hash, shape, dtype or length does not
match is a failed load (and its file is removed): a torn or corrupted file is recomputed, never served.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
import xxhash

logger = logging.getLogger(__name__)

# (device block id, tier slot, the block's prefix-cache hash)
BlockRef = tuple[int, int, bytes]

MAGIC = b"SLKV"
# What a disk entry holds besides its payload: magic, header length, header (bounded below), digest.
DISK_ENTRY_OVERHEAD = 512
_DIGEST_BYTES = 16
# How long a step with nothing else to run waits for a disk load before handing back (the core calls again).
_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class RemoteSource:
    """Where a pull's blocks are (prefill/decode disaggregation): the producer's transport, its address there, its
    cache layout, and when to give up (``time.monotonic()``)."""

    transport: str
    address: str
    layout: str
    deadline: float


@dataclass
class LoadJob:
    """One request's blocks to bring back: ``blocks`` in table order (a hash chain). ``source``: the producer
    engine they come from (its block ids in the slot places); None: this engine's offload tier."""

    job_id: int
    blocks: list[BlockRef]
    source: RemoteSource | None = None


@dataclass
class KVTransfer:
    """What one step moves between the device cache and the tier, done before the step's forward pass."""

    stores: list[BlockRef] = field(default_factory=list)     # device block -> slot (evicted blocks)
    loads: list[LoadJob] = field(default_factory=list)       # new jobs: slot -> device block
    cancelled: list[int] = field(default_factory=list)       # jobs whose request ended: never copy them in
    # Nothing else runs this step: wait a little for an in-flight load rather than return at once.
    idle: bool = False


def tier_slots(size_bytes: int, block_bytes: int, backend: str) -> int:
    """How many blocks of ``block_bytes`` a tier of ``size_bytes`` holds (a disk entry also carries its header)."""
    return size_bytes // (block_bytes + (DISK_ENTRY_OVERHEAD if backend == "disk" else 0))


def cache_block_bytes(kv_caches: list[torch.Tensor]) -> int:
    """Bytes of one block in every layer of ``kv_caches`` (each laid out ``[planes, num_blocks, ...]``)."""
    return sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches)


class HostTier:
    """``native``: slots in one host tensor ``[num_slots, layers, planes, block_size, heads, head_dim]``; each slot
    remembers the hash it holds, so a load of a slot that holds another block fails instead of serving it."""

    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int, pin: bool) -> None:
        first = kv_caches[0]
        shape = (num_slots, len(kv_caches), first.shape[0], *first.shape[2:])
        self.pool = torch.empty(shape, dtype=first.dtype, pin_memory=pin)
        self._tags: list[bytes | None] = [None] * num_slots

    def store(self, kv_caches: list[torch.Tensor], refs: list[BlockRef]) -> None:
        # One copy per block and layer: on CPU 10x faster than an advanced-index gather of the same blocks.
        for layer, cache in enumerate(kv_caches):
            for block_id, slot, _ in refs:
                self.pool[slot, layer].copy_(cache[:, block_id])
        for _, slot, block_hash in refs:
            self._tags[slot] = block_hash

    def load(self, kv_caches: list[torch.Tensor], refs: list[BlockRef]) -> int:
        """Copies the blocks in; returns how many (a prefix of ``refs``) were the ones asked for."""
        good = 0
        while good < len(refs) and self._tags[refs[good][1]] == refs[good][2]:
            good += 1
        for layer, cache in enumerate(kv_caches):
            for block_id, slot, _ in refs[:good]:
                cache[:, block_id].copy_(self.pool[slot, layer], non_blocking=True)
        return good


class DiskTier:
    """``disk``: one file per slot, written and read on one I/O thread in submission order (so a load queued after
    a store of the same slot reads what was stored)."""

    def __init__(self, directory: Path, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.directory = directory
        self.shape = list(block_shape)
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.nbytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.kv*"):   # a previous process's entries: their index died with it
            stale.unlink(missing_ok=True)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-io")
        self._warned = threading.Event()

    def path(self, slot: int) -> Path:
        return self.directory / f"{slot:08d}.kv"

    def submit_store(self, slot: int, block_hash: bytes, block: torch.Tensor) -> None:
        self._io.submit(self._write, slot, block_hash, block)

    def submit_load(self, slot: int, block_hash: bytes) -> Future[torch.Tensor | None]:
        return self._io.submit(self._read, slot, block_hash)

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def _header(self, block_hash: bytes) -> bytes:
        return msgspec.json.encode({"hash": block_hash.hex(), "shape": self.shape, "dtype": self.dtype_name})

    def _write(self, slot: int, block_hash: bytes, block: torch.Tensor) -> None:
        header = self._header(block_hash)
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        digest = xxhash.xxh3_128_digest(header + payload)
        target = self.path(slot)
        tmp = target.with_suffix(".kv.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                f.write(payload)
                f.write(digest)
            os.replace(tmp, target)
        except OSError as e:   # a full or failing disk loses the entry: its load fails and the block is recomputed
            if not self._warned.is_set():
                self._warned.set()
                logger.warning("KV offload: cannot write %s (%s); such blocks are recomputed", target, e)

    def _read(self, slot: int, block_hash: bytes) -> torch.Tensor | None:
        target = self.path(slot)
        try:
            data = target.read_bytes()
        except OSError:
            return None
        block = self.decode(data, block_hash)
        if block is None:
            logger.warning("KV offload: %s is torn or corrupted (or holds another block); it is dropped and the "
                           "block recomputed", target)
            target.unlink(missing_ok=True)
        return block

    def decode(self, data: bytes, block_hash: bytes) -> torch.Tensor | None:
        """The block an entry holds, or None unless it is intact and is ``block_hash``'s."""
        if len(data) < 8 + _DIGEST_BYTES or data[:4] != MAGIC:
            return None
        (header_len,) = struct.unpack("<I", data[4:8])
        end = 8 + header_len + self.nbytes
        if header_len > DISK_ENTRY_OVERHEAD or len(data) != end + _DIGEST_BYTES:
            return None
        if xxhash.xxh3_128_digest(data[8:end]) != data[end:]:
            return None
        if data[8:8 + header_len] != self._header(block_hash):   # hash, shape and dtype, as written
            return None
        return torch.frombuffer(bytearray(data[8 + header_len:end]), dtype=self.dtype).reshape(self.shape)


@dataclass
class _DiskLoad:
    job: LoadJob
    reads: list[Future[torch.Tensor | None]]


class KVTransferWorker:
    """Runs each step's :class:`KVTransfer` against this rank's cache tensors and its tier."""

    def __init__(self, kv_caches: list[torch.Tensor], *, size_bytes: int, backend: str, path: str | None,
                 pin: bool, rank: int = 0, data_parallel_rank: int = 0,
                 synchronize: Callable[[], None] | None = None) -> None:
        """``synchronize``: waits for the device's queued work (a disk store reads the block on the host)."""
        self.kv_caches = kv_caches
        self.block_bytes = cache_block_bytes(kv_caches)
        self.num_slots = tier_slots(size_bytes, self.block_bytes, backend)
        self._synchronize = synchronize
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        first = kv_caches[0]
        block_shape = (len(kv_caches), first.shape[0], *first.shape[2:])
        if backend == "disk":
            assert path is not None
            self.disk = DiskTier(Path(path) / f"sluice-kv-dp{data_parallel_rank}-rank{rank}", block_shape,
                                 first.dtype)
        else:
            self.host = HostTier(kv_caches, self.num_slots, pin)
        self._pending: dict[int, _DiskLoad] = {}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def execute(self, transfer: KVTransfer) -> dict[int, int]:
        """One step's transfer; returns ``{job id: blocks loaded intact}`` for the jobs that ended now."""
        for job_id in transfer.cancelled:
            self._pending.pop(job_id, None)
        if transfer.stores:
            self._store(transfer.stores)
        done: dict[int, int] = {}
        for job in transfer.loads:
            if self.host is not None:
                done[job.job_id] = self.host.load(self.kv_caches, job.blocks)
            else:
                assert self.disk is not None
                disk = self.disk
                self._pending[job.job_id] = _DiskLoad(job, [disk.submit_load(s, h) for _, s, h in job.blocks])
        if self._pending:
            done.update(self._land(wait=transfer.idle and not done))
        return done

    def _store(self, refs: list[BlockRef]) -> None:
        if any(s >= self.num_slots for _, s, _ in refs):
            raise ValueError(f"a store names a slot past the tier's {self.num_slots}")
        if self.host is not None:
            self.host.store(self.kv_caches, refs)
            return
        assert self.disk is not None
        if self._synchronize is not None:
            self._synchronize()
        for block_id, slot, block_hash in refs:
            block = torch.stack([cache[:, block_id] for cache in self.kv_caches]).to("cpu")
            self.disk.submit_store(slot, block_hash, block)

    def _land(self, wait: bool) -> dict[int, int]:
        """Copies in the disk loads whose reads have all finished (``wait``: after waiting a little for one)."""
        if wait:
            first = next(iter(self._pending.values()))
            wait_futures(first.reads, timeout=_IDLE_WAIT_S)
        done: dict[int, int] = {}
        for job_id, load in list(self._pending.items()):
            if not all(f.done() for f in load.reads):
                continue
            del self._pending[job_id]
            good: list[tuple[int, torch.Tensor]] = []
            for (block_id, _, _), read in zip(load.job.blocks, load.reads):
                block = read.result()
                if block is None:
                    break
                good.append((block_id, block))
            dev = self.kv_caches[0].device
            for block_id, block in good:
                data = block.to(dev, non_blocking=True)
                for layer, cache in enumerate(self.kv_caches):
                    cache[:, block_id] = data[layer]
            done[job_id] = len(good)
        return done
