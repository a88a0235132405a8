"""Paged attention over a multi-head latent attention (MLA) cache, in PyTorch ops (any device).

The cache of one layer is ``(1, num_blocks, block_size, 1, latent_dim)``: per token, DeepSeek's compressed latent
``c_kv`` (``kv_lora_rank`` values, after its RMSNorm) followed by the rotated shared key ``k_pe``
(``qk_rope_head_dim``), one "head" for all query heads — what DeepSeek's own inference code and vLLM's MLA backends
keep, a fraction of the keys and values of every head. A token's slot is ``block_id * block_size + offset`` as in the
default layout (:mod:`engine.attention.backend`), so the block manager, prefix caching and copy-on-write work on it
unchanged.

* Decode rows attend in the latent space (the up-projections absorbed into the query and the output, by the caller):
  a query ``[c_q | q_pe]`` of ``latent_dim`` per head against every cached latent, values the latents' first
  ``kv_lora_rank`` values.
* Prefill chunks are expanded: the caller turns the sequence's cached latents into per-head keys and values
  (``kv_b_proj``) and attends as usual; cheaper than absorption when many queries share the keys.

An attention backend hands the model its :class:`LatentAttention` (``AttentionBackend.latent_attention``): these
PyTorch ops by default, a device's own operators where it has them (the NPU's).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.attention.backend import AttentionMetadata


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, latent_dim] into the slots of the step's tokens."""
    flat = cache.view(-1, cache.shape[-1])
    flat.index_copy_(0, slot_mapping, latent.to(cache.dtype))


def gather_latents(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The cached latents of the first ``num_blocks`` blocks of each row of ``block_tables``:
    [rows, num_blocks * block_size, latent_dim]."""
    _, _, block_size, _, dim = cache.shape
    ids = block_tables[:, :num_blocks]
    rows = ids.shape[0]
    return cache[0].index_select(0, ids.reshape(-1)).view(rows, num_blocks * block_size, dim)


def decode_latent_attention(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kv_lora_rank: int,
                            scale: float) -> torch.Tensor:
    """The step's decode rows (its first ``meta.num_decodes`` sequences, one token each): query [N, H, latent_dim]
    (absorbed) -> [N, H, kv_lora_rank], attention-weighted sums of the cached latents."""
    n = meta.num_decodes
    block_size = meta.block_size
    max_len = max(meta.seq_lens_host[:n])
    num_blocks = -(-max_len // block_size)
    latents = gather_latents(cache, meta.block_tables[:n], num_blocks).to(query.dtype)  # [N, S, D]
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = positions[None, :] < meta.seq_lens[:n, None]
    heads = query.shape[1]
    keys = latents[:, None].expand(n, heads, latents.shape[1], latents.shape[2])
    values = latents[:, None, :, :kv_lora_rank].expand(n, heads, latents.shape[1], kv_lora_rank)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                         scale=scale)
    return out.squeeze(2)


def sequence_latents(cache: torch.Tensor, meta: AttentionMetadata, seq_index: int) -> torch.Tensor:
    """Every cached latent of sequence ``seq_index`` of the step, its new tokens' included: [seq_len, latent_dim]."""
    seq_len = meta.seq_lens_host[seq_index]
    num_blocks = -(-seq_len // meta.block_size)
    return gather_latents(cache, meta.block_tables[seq_index:seq_index + 1], num_blocks)[0, :seq_len]


def prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's chunk: query [Q, H, Dk] at the last Q positions of keys / values [S, H, Dk|Dv] (the expanded
    latents of its whole context), causal. Returns [Q, H, Dv]."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    q, k, v = query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


class LatentAttention:
    """The latent cache's three operations, in PyTorch ops (the functions above)."""

    def write(self, latent: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> None:
        write_latent(latent, cache, meta.slot_mapping)

    def decode(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kv_lora_rank: int,
               scale: float) -> torch.Tensor:
        return decode_latent_attention(query, cache, meta, kv_lora_rank, scale)

    def sequence_latents(self, cache: torch.Tensor, meta: AttentionMetadata, seq_index: int) -> torch.Tensor:
        return sequence_latents(cache, meta, seq_index)
