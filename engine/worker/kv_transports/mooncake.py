"""Cross-host transport (``MooncakeConnector``): Mooncake's transfer engine over TCP, peers found by handshake
(``P2PHANDSHAKE``, no metadata server).

A producer registers each layer's KV cache with its transfer engine and publishes
``host:port|0x<layer 0 base>,0x<layer 1 base>,...``: the engine's session (where its handshake listens) and the
address of each layer's cache in the producer's memory. A consumer reads each block's run of bytes, per plane and
layer, in groups of about ``_GROUP_BYTES`` (one batched read each, consecutive blocks merged into one run), so that
a failure or the deadline leaves a prefix of whole blocks.

A group lands in a staging buffer of the consumer's and is copied into its cache once the whole group has arrived.
The engine cannot cancel a read: after one failed or outlived the deadline, bytes still in flight may land later
(a producer that stalls and resumes sends them then). Only a staging buffer can receive them, and it is not reused
until that cannot happen: ``_GRACE_S`` after a read that failed at once (a refused or reset connection, a
rejected address), never after one that hung, unless it completes. The blocking calls run on a few threads of the
transport's, so that ``read`` returns by its deadline even when the first contact with a silent producer blocks
the engine for a minute; a producer with a read still hanging is not asked again until that read returns.

The TCP transport listens on two ports, the handshake's and the data's: with ``kv_port`` P they are P and P + 1
(which is which is the engine's choice), so a firewall opens both; with 0 any free ones. Both listen on every
interface; ``kv_ip`` is the address consumers reach the producer at.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kv_transfer_config import KVTransferConfig
from engine.worker.kv_transports import CacheLayout, KVTransport

logger = logging.getLogger(__name__)

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# One batched read moves about this many bytes: enough to keep the engine's TCP lane busy, well under what its
# queue takes at once (a 64 MiB batch is refused whole), small enough that the deadline is checked often.
_GROUP_BYTES = 8 << 20
# The transfer engine reads these: the range its two listening ports are taken from (when the module is first
# imported) and how long one batched read may take (when an engine is made; seconds, 5 at least, plus 1 ns a byte).
_PORT_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
_GROUP_TIMEOUT_S = 5
# How long a staging buffer rests after a read into it failed at once, and how many buffers of reads that hung
# may be held (each _GROUP_BYTES) before reads are refused.
_GRACE_S = 30.0
_MAX_STRANDED = 16
_READ_THREADS = 4


@dataclass
class _Group:
    """One batched read: each transfer's remote address, length and place in the staging buffer, and where each
    lands in the cache (layer, byte offset)."""

    remote: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    staged: list[int] = field(default_factory=list)
    local: list[tuple[int, int]] = field(default_factory=list)
    nbytes: int = 0


def _port_problem(port: int) -> str | None:
    """Why the transfer engine cannot listen on ``port`` and ``port + 1``; None when it can try."""
    if port >= 65535:
        return "Mooncake's TCP transport listens on kv_port and kv_port + 1"
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return None
    if port <= high and port + 1 >= low:   # the engine ignores a range that meets the ephemeral one
        return f"Mooncake takes no port in this host's ephemeral range ({low}-{high}): choose one outside it"
    return None


def format_address(session: str, bases: Sequence[int]) -> str:
    return session + "|" + ",".join(f"{base:#x}" for base in bases)


def parse_address(address: str) -> tuple[str, list[int]]:
    """``host:port|0x...,0x...`` -> (session, [layer base, ...]); ValueError when it is not one."""
    session, sep, rest = address.partition("|")
    host, _, port = session.rpartition(":")
    if not sep or not host or not port.isdigit() or not rest:
        raise ValueError(f"not a Mooncake address (host:port|0x<base>,...): {address!r}")
    return session, [int(base, 16) for base in rest.split(",")]


def _runs(blocks: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """``(remote, local, count)`` runs of pairs consecutive on both sides, so that each is one transfer."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != (blocks[i - 1][0] + 1, blocks[i - 1][1] + 1):
            yield blocks[start][0], blocks[start][1], i - start
            start = i


class MooncakeTransport(KVTransport):
    name = "mooncake"

    def __init__(self, config: KVTransferConfig) -> None:
        env: dict[str, str] = {_TIMEOUT_ENV: str(_GROUP_TIMEOUT_S)}
        if config.kv_port:
            problem = _port_problem(config.kv_port)
            if problem is not None:
                raise RuntimeError(f"kv_port {config.kv_port}: {problem}")
            env |= dict(zip(_PORT_RANGE_ENV, (str(config.kv_port), str(config.kv_port + 1))))
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            try:
                from mooncake.engine import TransferEngine
            except ImportError as e:
                raise RuntimeError(
                    f"MooncakeConnector needs Mooncake's transfer engine: pip install {PIP_PACKAGE}, and its system "
                    f"libraries, Debian's libibverbs1 and libnuma1 (apt-get install libibverbs1 libnuma1) ({e})"
                ) from e
            self._engine = TransferEngine()
            rc = self._engine.initialize(config.kv_ip, config.metadata_server, config.protocol, "")
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if rc != 0:
            ports = f", ports {config.kv_port} and {config.kv_port + 1} (both must be free)" if config.kv_port else ""
            raise RuntimeError(f"Mooncake's transfer engine did not start on {config.kv_ip}{ports} "
                               f"({config.protocol}, {config.metadata_server}): {rc}")
        port = self._engine.get_rpc_port()
        if config.kv_port and not config.kv_port <= port <= config.kv_port + 1:
            # The range is read once per process: a second transport here keeps the first's.
            raise RuntimeError(f"Mooncake's transfer engine listens on {port}, not kv_port {config.kv_port}")
        host = f"[{config.kv_ip}]" if ":" in config.kv_ip else config.kv_ip
        self.session = f"{host}:{port}"
        self._registered: dict[int, int] = {}   # base address -> bytes, of the memory the engine may touch
        self._lock = threading.Lock()   # the staging buffers' lists; reads may come from several threads
        self._free: list[torch.Tensor] = []   # staging buffers nothing can still write into
        self._resting: list[tuple[float, torch.Tensor]] = []   # (reusable from, buffer) after a read failed at once
        self._stranded: dict[int, tuple[str, Future[int]]] = {}   # buffer base -> (session, read): reads that hung
        self._buffers: dict[int, torch.Tensor] = {}   # every staging buffer, by base (they live as long as we do)
        self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="mooncake-read")

    def _register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each tensor's memory with the engine (once: a tensor published twice is one)."""
        for tensor in tensors:
            base, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            if self._registered.get(base) == nbytes:
                continue
            if not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise RuntimeError("Mooncake's TCP transport reads contiguous host memory only: the KV cache is "
                                   f"{'not contiguous' if tensor.device.type == 'cpu' else tensor.device}")
            # A registered region this one overlaps held tensors since freed (live memory is never handed out
            # twice): the engine refuses overlapping regions, so it goes.
            for old in [b for b, n in self._registered.items() if b < base + nbytes and base < b + n]:
                self._engine.unregister_memory(old)
                del self._registered[old]
            rc = self._engine.register_memory(base, nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake could not register {nbytes} bytes at {base:#x}: {rc}")
            self._registered[base] = nbytes

    def publish(self, kv_caches: list[torch.Tensor]) -> str:
        self._register(kv_caches)
        return format_address(self.session, [cache.data_ptr() for cache in kv_caches])

    def read(self, address: str, layout: CacheLayout, blocks: Sequence[tuple[int, int]],
             kv_caches: list[torch.Tensor], deadline: float) -> int:
        if not blocks:
            return 0
        try:
            session, bases = parse_address(address)
        except ValueError as e:
            logger.warning("KV transfer: %s; its blocks are recomputed", e)
            return 0
        local = CacheLayout.of(kv_caches)
        problem = self._mismatch(layout, local, bases, blocks)
        with self._lock:
            if problem is None and any(s == session and not f.done() for s, f in self._stranded.values()):
                problem = "an earlier read from it has not returned"
        if problem is not None:
            logger.warning("KV transfer from %s: %s; its blocks are recomputed", session, problem)
            return 0
        per_group = max(1, _GROUP_BYTES // layout.block_bytes)
        done = 0
        while done < len(blocks):
            chunk = blocks[done:done + per_group]
            outcome = self._read_group(session, self._plan(layout, local, bases, chunk), kv_caches, deadline)
            if outcome is not None:
                logger.warning("KV transfer from %s: %s after %d of %d blocks; the rest are recomputed", session,
                               outcome, done, len(blocks))
                return done
            done += len(chunk)
        return done

    def _read_group(self, session: str, group: _Group, kv_caches: list[torch.Tensor], deadline: float) -> str | None:
        """Read ``group`` through a staging buffer into ``kv_caches``; None when it arrived, else what happened."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timed out"
        buffer = self._take_buffer(group.nbytes)
        if buffer is None:
            return f"{len(self._stranded)} earlier reads hang on unresponsive producers (no staging buffer left)"
        base = buffer.data_ptr()
        started = time.monotonic()
        future = self._pool.submit(self._engine.batch_transfer_sync_read, session, [base + o for o in group.staged],
                                   group.remote, group.lengths)
        try:
            rc = future.result(timeout=remaining)
        except FutureTimeout:
            with self._lock:
                self._stranded[base] = (session, future)
            future.add_done_callback(lambda f: self._hung_read_returned(base, f))
            return "timed out"
        if rc != 0:
            with self._lock:
                if time.monotonic() - started < _GROUP_TIMEOUT_S:
                    self._resting.append((time.monotonic() + _GRACE_S, buffer))
                else:   # the engine gave up on it: a stalled producer may still send its bytes
                    self._stranded[base] = (session, future)
            return f"failed ({rc}: the producer gone, unreachable, or refusing the addresses)"
        staged = buffer.numpy()
        caches = [cache.view(-1).view(torch.uint8).numpy() for cache in kv_caches]
        for (layer, offset), start, length in zip(group.local, group.staged, group.lengths):
            np.copyto(caches[layer][offset:offset + length], staged[start:start + length])
        with self._lock:
            self._free.append(buffer)
        return None

    def _take_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A staging buffer of at least ``nbytes`` that nothing can still write into; None when none may be made."""
        with self._lock:
            now = time.monotonic()
            self._free += [b for t, b in self._resting if t <= now]
            self._resting = [(t, b) for t, b in self._resting if t > now]
            for i, buffer in enumerate(self._free):
                if buffer.numel() >= nbytes:
                    return self._free.pop(i)
            if len(self._stranded) >= _MAX_STRANDED:
                return None
            buffer = torch.empty(max(nbytes, _GROUP_BYTES), dtype=torch.uint8)
            self._register([buffer])
            self._buffers[buffer.data_ptr()] = buffer
            return buffer

    def _hung_read_returned(self, base: int, future: Future[int]) -> None:
        """A read that outlived its deadline returned: its buffer is free again if every byte of it arrived."""
        if future.cancelled() or future.exception() is not None or future.result() != 0:
            return
        with self._lock:
            self._stranded.pop(base, None)
            self._free.append(self._buffers[base])

    @staticmethod
    def _mismatch(remote: CacheLayout, local: CacheLayout, bases: list[int],
                  blocks: Sequence[tuple[int, int]]) -> str | None:
        """Why ``blocks`` cannot be read from a producer with ``remote`` layout at ``bases``; None when they can."""
        if not remote.matches(local):
            return f"its cache layout {remote.text()} does not match ours ({local.text()})"
        if len(bases) != remote.layers:
            return f"its address names {len(bases)} layers, its layout {remote.layers}"
        bad = [(r, lo) for r, lo in blocks if not (0 <= r < remote.num_blocks and 0 <= lo < local.num_blocks)]
        if bad:
            return f"block pair {bad[0]} is outside the caches ({remote.num_blocks} and {local.num_blocks} blocks)"
        return None

    @staticmethod
    def _plan(remote: CacheLayout, local: CacheLayout, bases: list[int], blocks: Sequence[tuple[int, int]]) -> _Group:
        """One transfer per run of consecutive blocks, per plane and layer, laid end to end in the staging buffer."""
        group = _Group()
        runs = list(_runs(blocks))
        for layer, base in enumerate(bases):
            for plane in range(remote.planes):
                for r, lo, count in runs:
                    length = remote.plane_block_bytes * count
                    group.remote.append(base + remote.offset(plane, r))
                    group.local.append((layer, local.offset(plane, lo)))
                    group.staged.append(group.nbytes)
                    group.lengths.append(length)
                    group.nbytes += length
        return group

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for base in self._registered:
            self._engine.unregister_memory(base)
        self._registered.clear()
