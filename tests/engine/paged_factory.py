"""A tiny stand-in for the block manager + runner input builder, for model and attention tests.

It hands out KV blocks in a shuffled order (so block tables are non-contiguous) and builds the
``AttentionMetadata`` of a step from (sequence id, new token ids) chunks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, kv_cache_shape
from engine.attention.torch_backend import TorchAttentionBackend


@dataclass
class Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass
class PagedKV:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int = 64
    block_size: int = 4
    dtype: torch.dtype = torch.float32
    seed: int = 0
    backend: AttentionBackend = field(default_factory=TorchAttentionBackend)
    kv_caches: list[torch.Tensor] = field(init=False)
    tables: dict[str, list[int]] = field(init=False, default_factory=dict)
    tokens: dict[str, list[int]] = field(init=False, default_factory=dict)
    free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        shape = kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # Garbage, not zeros: a read of a slot that was never written must show up in the results.
        self.kv_caches = [torch.randn(shape, generator=gen).mul_(10).to(self.dtype) for _ in range(self.num_layers)]
        self.free = list(range(1, self.num_blocks))  # block 0 doubles as the padding id; keep it unused
        random.Random(self.seed).shuffle(self.free)

    def step(self, chunks: list[tuple[str, list[int]]], num_decodes: int | None = None) -> Step:
        """One step over ``chunks`` (decodes first). ``num_decodes`` defaults to the number of leading
        single-token chunks of sequences that already have context."""
        if num_decodes is None:
            num_decodes = 0
            for seq_id, new in chunks:
                if len(new) != 1 or not self.tokens.get(seq_id):
                    break
                num_decodes += 1
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        for seq_id, new in chunks:
            history = self.tokens.setdefault(seq_id, [])
            table = self.tables.setdefault(seq_id, [])
            start = len(history)
            history.extend(new)
            while len(table) * self.block_size < len(history):
                table.append(self.free.pop())
            for pos in range(start, len(history)):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids.extend(new)
            seq_lens.append(len(history))
        width = max(len(self.tables[s]) for s, _ in chunks) + 1  # + 1: some padding always present
        block_tables = torch.zeros(len(chunks), width, dtype=torch.int64)
        for row, (seq_id, _) in enumerate(chunks):
            block_tables[row, :len(self.tables[seq_id])] = torch.tensor(self.tables[seq_id])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            query_lens=[len(new) for _, new in chunks],
            seq_lens_host=seq_lens,
            num_decodes=num_decodes,
            block_size=self.block_size,
            backend=self.backend,
        )
        return Step(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta)


def nan_padded_cache(gen: torch.Generator, lens: list[int], n_blocks: int, block_size: int, hkv: int,
                     d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random bfloat16 cache and block tables (blocks scattered at random) for sequences of ``lens`` tokens;
    every slot no sequence owns is NaN, so a kernel that reads past a sequence's end shows it."""
    per_seq = (max(lens) + block_size - 1) // block_size
    cache = torch.randn(kv_cache_shape(n_blocks, block_size, hkv, d), generator=gen).bfloat16()
    tables = torch.randperm(n_blocks, generator=gen)[:len(lens) * per_seq].view(len(lens), per_seq)
    used = torch.zeros(n_blocks, block_size, dtype=torch.bool)
    for n, length in enumerate(lens):
        for t in range(length):
            used[tables[n, t // block_size], t % block_size] = True
    cache[:, ~used] = float("nan")
    return cache, tables


def dense_causal_attention(query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, context: int, new: int,
                           group: int, dtype: torch.dtype) -> torch.Tensor:
    """One sequence's prefill attention computed densely in ``dtype``: its ``new`` query rows [new, H, d] at
    positions ``context``.. over its ``context + new`` keys read through ``table`` (H = KV heads × ``group``)."""
    length = context + new
    hkv, d = cache.shape[-2], cache.shape[-1]
    keys = cache[0][table].reshape(-1, hkv, d)[:length].to(dtype).repeat_interleave(group, dim=1)
    values = cache[1][table].reshape(-1, hkv, d)[:length].to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", query.to(dtype), keys) * d ** -0.5
    visible = torch.arange(length)[None, :] <= torch.arange(context, length)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hql,lhd->qhd", probs, values)
