"""Cross-host transport (``MooncakeConnector``): Mooncake's transfer engine over TCP, peers found by handshake
(``P2PHANDSHAKE``, no metadata server).

A producer registers each layer's KV cache with its transfer engine and publishes
``host:port|0x<layer 0 base>,0x<layer 1 base>,...``: the engine's session (where its handshake listens) and the
address of each layer's cache in the producer's memory. A consumer registers its own cache once and reads each
block's run of bytes, per plane and layer, straight from the producer's cache into its own: one copy, no
serialisation. Blocks are read in groups of about ``_GROUP_BYTES``, one batched read per group, so that a failure
or the deadline leaves a prefix of whole blocks; the deadline is checked between groups (a group in flight is
bounded by the engine's own transfer timeout, at least 5 s).

The TCP transport listens on two ports, the handshake's and the data's: with ``kv_port`` P they are P and P + 1
(which is which is the engine's choice), so a firewall opens both; with 0 any free ones. Both listen on every
interface; ``kv_ip`` is the address consumers reach the producer at.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence

import torch

from engine.kv_transfer_config import KVTransferConfig
from engine.worker.kv_transports import CacheLayout, KVTransport

logger = logging.getLogger(__name__)

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# One batched read moves about this many bytes: large enough to keep the engine's workers busy, small enough that
# the deadline is checked often and a failure loses little.
_GROUP_BYTES = 16 << 20
# The transfer engine reads these: the range its two listening ports are taken from (when the module is first
# imported) and how long one batched read may take (when an engine is made; seconds, 5 at least, plus 1 ns a byte).
_PORT_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
_GROUP_TIMEOUT_S = 5

Entries = tuple[list[int], list[int], list[int]]   # local addresses, remote addresses, lengths


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
        self._registered: dict[int, int] = {}   # base address -> bytes, of the tensors the engine may touch

    def _register(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Register each tensor's memory with the engine (once: a tensor both published and read into is one)."""
        for cache in kv_caches:
            base, nbytes = cache.data_ptr(), cache.numel() * cache.element_size()
            if self._registered.get(base) == nbytes:
                continue
            if not cache.is_contiguous() or cache.device.type != "cpu":
                raise RuntimeError("Mooncake's TCP transport reads contiguous host memory only: the KV cache is "
                                   f"{'not contiguous' if cache.device.type == 'cpu' else cache.device}")
            # A registered region this one overlaps held tensors since freed (live memory is never handed out
            # twice): the engine refuses overlapping regions, so it goes.
            for old in [b for b, n in self._registered.items() if b < base + nbytes and base < b + n]:
                self._engine.unregister_memory(old)
                del self._registered[old]
            rc = self._engine.register_memory(base, nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake could not register {nbytes} bytes of KV cache at {base:#x}: {rc}")
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
        if problem is None:
            try:
                self._register(kv_caches)
            except RuntimeError as e:
                problem = str(e)
        if problem is not None:
            logger.warning("KV transfer from %s: %s; its blocks are recomputed", session, problem)
            return 0
        group = max(1, _GROUP_BYTES // layout.block_bytes)
        done = 0
        while done < len(blocks):
            if time.monotonic() >= deadline:
                logger.warning("KV transfer from %s: timed out after %d of %d blocks; the rest are recomputed",
                               session, done, len(blocks))
                return done
            chunk = blocks[done:done + group]
            local_addrs, remote_addrs, lengths = self._entries(layout, local, bases, kv_caches, chunk)
            rc = self._engine.batch_transfer_sync_read(session, local_addrs, remote_addrs, lengths)
            if rc != 0:
                logger.warning("KV transfer from %s failed (%d) after %d of %d blocks (the producer gone or "
                               "unreachable?); the rest are recomputed", session, rc, done, len(blocks))
                return done
            done += len(chunk)
        return done

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
    def _entries(remote: CacheLayout, local: CacheLayout, bases: list[int], kv_caches: list[torch.Tensor],
                 blocks: Sequence[tuple[int, int]]) -> Entries:
        """One transfer per run of consecutive blocks, per plane and layer."""
        run = remote.plane_block_bytes
        local_addrs: list[int] = []
        remote_addrs: list[int] = []
        lengths: list[int] = []
        runs = list(_runs(blocks))
        for base, cache in zip(bases, kv_caches):
            local_base = cache.data_ptr()
            for plane in range(remote.planes):
                for r, lo, count in runs:
                    remote_addrs.append(base + remote.offset(plane, r))
                    local_addrs.append(local_base + local.offset(plane, lo))
                    lengths.append(run * count)
        return local_addrs, remote_addrs, lengths

    def close(self) -> None:
        for base in self._registered:
            self._engine.unregister_memory(base)
        self._registered.clear()
