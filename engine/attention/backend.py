"""The attention backend protocol and the per-step metadata it builds.

A backend owns its KV cache: the layout of one layer's cache, its allocation, the block copies of copy-on-write
forks, and the device-side metadata of a step, built from the runner's host-side :class:`StepLayout`. The
default layout is ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` — index 0 holds keys, 1 values; a
token's slot is ``block_id * block_size + offset``; a sequence's block table lists its block ids in order.
Backends with another layout (NPU: block size 128, its own operators) override what differs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.attention.mla import LatentAttention


class CacheMemory(Protocol):
    """Where a backend allocates its KV caches. ``engine.device.base.Device`` is one; devices sit above attention
    (each picks its backend), so the backend names only the method it calls."""

    def empty_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


@dataclass
class StepLayout:
    """A step's tokens as the runner laid them out on the host: sequence by sequence, flat, no padding, the
    ``num_decodes`` single-token sequences first."""

    slot_mapping: torch.Tensor  # int64 [num_tokens] (host): block_id * block_size + offset of each new token
    block_tables: np.ndarray    # int64 [num_seqs, max_blocks_per_seq], padded with 0
    query_lens: list[int]       # new tokens per sequence
    seq_lens: list[int]         # tokens in the KV cache after this step (context + new)
    num_decodes: int
    block_size: int


@dataclass
class AttentionMetadata:
    """Where a step's tokens come from and go to, on the device (see :class:`StepLayout`)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks_per_seq], padded with 0
    seq_lens: torch.Tensor  # int64 [num_seqs]
    query_lens: list[int]  # host-side: new tokens per sequence
    seq_lens_host: list[int]  # host-side copy of seq_lens
    num_decodes: int
    block_size: int
    backend: AttentionBackend
    # What a backend derives from these once per step for all layers (e.g. per-row block tables), by its own key.
    derived: dict[object, object] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   planes: int = 2) -> tuple[int, ...]:
    """Shape of one layer's KV cache in the default layout: keys at index 0, values at index 1 (``planes`` 1: one
    latent per token, multi-head latent attention's cache, ``engine.attention.mla``)."""
    return (planes, num_blocks, block_size, num_kv_heads, head_dim)


class AttentionBackend(ABC):
    """Paged attention over a KV cache this backend lays out and allocates."""

    def latent_attention(self) -> LatentAttention:
        """The operations of a multi-head latent attention cache (one latent per token) on this backend."""
        from engine.attention.mla import LatentAttention

        return LatentAttention()

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       planes: int = 2) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, planes)

    def allocate_kv_caches(self, device: CacheMemory, num_layers: int, num_blocks: int, block_size: int,
                           num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           planes: int = 2) -> list[torch.Tensor]:
        """One zeroed cache per layer: padded block-table entries are gathered then masked, and uninitialised
        memory could hold NaNs that a zero attention weight does not cancel."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, planes)
        return [device.empty_cache_tensor(shape, dtype).zero_() for _ in range(num_layers)]

    def build_metadata(self, layout: StepLayout, device: torch.device) -> AttentionMetadata:
        num_tokens = sum(layout.query_lens)
        return AttentionMetadata(
            slot_mapping=layout.slot_mapping[:num_tokens].to(device, non_blocking=True),
            block_tables=torch.from_numpy(layout.block_tables).to(device, non_blocking=True),
            seq_lens=torch.tensor(layout.seq_lens, dtype=torch.int64).to(device, non_blocking=True),
            query_lens=layout.query_lens,
            seq_lens_host=layout.seq_lens,
            num_decodes=layout.num_decodes,
            block_size=layout.block_size,
            backend=self,
        )

    def copy_blocks(self, kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``src``'s keys and values into ``dst``, in every layer."""
        dev = kv_caches[0].device
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=dev)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=dev)
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] for the step's new tokens; writes key/value into
        kv_cache at meta.slot_mapping, then attends each new token causally over its sequence's cached
        context and itself — over its last ``window`` positions only (itself included), when given (a
        sliding-window layer), with scores soft-capped to ``softcap`` when given (Gemma 2). Returns [T, Hq, D]."""
