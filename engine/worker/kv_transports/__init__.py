"""Transports of prefill/decode disaggregation: how a consumer (decode) engine's worker reads the KV blocks a
producer (prefill) engine holds for it, one copy from the producer's cache into its own, no serialisation.

A transport has two sides. The producer ``publish``es its KV cache (after the worker allocated it, in memory the
transport gave where it needs its own: ``cache_memory``) and gets the address consumers reach it at
(``KVTransferParams.remote_address``). The consumer ``read``s a list of (remote block, local block) pairs from such
an address into its cache and says how many of them, a prefix, arrived; a failure (the producer gone, a timeout)
is a short count, never an exception, and the scheduler recomputes the rest.

A cache is a list of per-layer tensors ``[planes, num_blocks, block_size, heads, head_dim]``
(``engine.attention.backend.kv_cache_shape``): one block of one plane of one layer is one contiguous run of bytes.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.backend import CacheMemory
from engine.kv_transfer_config import KVTransferConfig

_LAYOUT = re.compile(r"^(\w+) (\d+)x(\d+)x(\d+)x(\d+)x(\d+)x(\d+)$")


@dataclass(frozen=True)
class CacheLayout:
    """The shape of an engine's KV cache, which a producer sends with its blocks (``KVTransferParams.layout``):
    a consumer reads blocks only from a cache whose layout equals its own but for the number of blocks."""

    dtype: str
    layers: int
    planes: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int

    @classmethod
    def of(cls, kv_caches: Sequence[torch.Tensor]) -> CacheLayout:
        first = kv_caches[0]
        planes, num_blocks, block_size, heads, head_dim = first.shape
        return cls(str(first.dtype).removeprefix("torch."), len(kv_caches), planes, num_blocks, block_size, heads,
                   head_dim)

    @classmethod
    def parse(cls, text: str) -> CacheLayout | None:
        """The layout ``text`` describes; None when it is not one."""
        m = _LAYOUT.match(text)
        if m is None:
            return None
        return cls(m[1], *(int(g) for g in m.groups()[1:]))

    def text(self) -> str:
        return (f"{self.dtype} {self.layers}x{self.planes}x{self.num_blocks}x{self.block_size}x{self.heads}x"
                f"{self.head_dim}")

    def matches(self, other: CacheLayout) -> bool:
        """Blocks of ``other`` can be copied into a cache of this layout (everything equal but the block count)."""
        return (self.dtype, self.layers, self.planes, self.block_size, self.heads, self.head_dim) == (
            other.dtype, other.layers, other.planes, other.block_size, other.heads, other.head_dim)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def plane_block_bytes(self) -> int:
        """Bytes of one block of one plane of one layer (one contiguous run)."""
        return self.block_size * self.heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in every plane and layer."""
        return self.layers * self.planes * self.plane_block_bytes

    def offset(self, plane: int, block: int) -> int:
        """Byte offset of ``block``'s run of ``plane`` within one layer's cache."""
        return (plane * self.num_blocks + block) * self.plane_block_bytes


@dataclass(frozen=True)
class KVSource:
    """Where a producer's consumers reach its cache: the transport, its address there, the cache's layout."""

    transport: str
    address: str
    layout: str
    engine_id: str


class KVTransport(ABC):
    """One engine's side of a transport (``KVTransferConfig.transport``)."""

    name: str

    def cache_memory(self, device: CacheMemory) -> CacheMemory:
        """Where the worker allocates its KV cache (a producer's transport may need memory of its own)."""
        return device

    @abstractmethod
    def publish(self, kv_caches: list[torch.Tensor]) -> str:
        """A producer: make ``kv_caches`` readable by consumers; returns the address they reach them at."""

    @abstractmethod
    def read(self, address: str, layout: CacheLayout, blocks: Sequence[tuple[int, int]],
             kv_caches: list[torch.Tensor], deadline: float) -> int:
        """A consumer: copy each ``(remote block, local block)`` of the producer at ``address`` (whose cache has
        ``layout``) into ``kv_caches``, in order, giving up at ``deadline`` (``time.monotonic()``). Returns how many
        of them, a prefix, arrived intact; never raises for a failed transfer."""

    def close(self) -> None:
        """Release what the transport holds (its mappings, its connections)."""


def make_transport(config: KVTransferConfig) -> KVTransport:
    """The transport ``config`` names (imported only when chosen)."""
    if config.transport == "shm":
        from engine.worker.kv_transports.shm import SharedMemoryTransport

        return SharedMemoryTransport()
    from engine.worker.kv_transports.mooncake import MooncakeTransport

    return MooncakeTransport(config)
