"""TEST-ONLY TWIN of torch-npu's multi-head latent attention (MLA) cache operators, on the CPU, in the forms
vLLM-Ascend's MLA backend called them (``vllm_ascend/attention/mla_v1.py``, from its first version through the
chunked-prefill one, ab5d110): torch-npu's ATB bindings (op-plugin ``op_plugin/ops/atb``), both over one cache
[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] that keeps each token's latent and rotated shared key:

* ``_npu_reshape_and_cache_siso(key, key_cache, slot_indices)``: ReshapeAndCacheOperation with
  ``kvCacheCfg=K_CACHE_V_BYPASS`` (only a key cache; CANN ATB reference, ReshapeAndCacheOperation): key
  [num_tokens, num_head, head_size], keyCache [num_blocks, block_size, num_head, head_size], ND, one dtype
  (float16/bf16/int8) for both; slotMapping int32 [num_tokens], ``block_id * block_size + offset``, in the cache and
  without repeats;
* ``_npu_paged_attention_mla(query, key_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens,
  mla_vheadsize, out)``: PagedAttentionOperation with ``mlaVHeadSize > 0`` (the MLA merged-kvCache feature, CANN
  8.1 ATB reference): no value cache, the values being the first ``mla_vheadsize`` numbers of each cached key; MQA
  only (one kv head); query and keyCache head_size in (0, 576], ``mla_vheadsize`` at most that; block_size a multiple
  of 16 and at most 128 when head_size > 256; 0 < batch <= 8192; float16/bf16 query and cache of one dtype, int32
  block tables, int32 context lengths on the host (as ``_npu_paged_attention`` takes them).

The math is float32 softmax attention, cast to the query's dtype at the end.
"""
from __future__ import annotations

import torch

from tests.engine.npu_twin._ops import operator, require, require_contiguous, require_dtype

HALF = (torch.float16, torch.bfloat16)
MLA_MAX_HEAD_SIZE = 576   # the merged-kvCache feature's head_size limit (DeepSeek's 512 + 64)
MAX_BATCH = 8192


@operator
def _npu_reshape_and_cache_siso(key: torch.Tensor, key_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """Writes token t's key [num_head, head_size] into slot ``slot_indices[t]`` (block ``slot // block_size``, row
    ``slot % block_size``) of ``key_cache``, in place."""
    op = "_npu_reshape_and_cache_siso"
    require(key_cache.dim() == 4, f"{op}: key_cache must be 4-D [num_blocks, block_size, num_head, head_size], got "
                                  f"{tuple(key_cache.shape)}")
    require_dtype("key_cache", op, key_cache, HALF + (torch.int8,))
    require_contiguous("key_cache", op, key_cache)
    num_blocks, block_size, heads, head_size = key_cache.shape
    require(key.dim() == 3 and tuple(key.shape[1:]) == (heads, head_size),
            f"{op}: key must be [num_tokens, {heads}, {head_size}] (the cache's heads and head size), got "
            f"{tuple(key.shape)}")
    require(key.dtype == key_cache.dtype, f"{op}: key must have the cache's dtype {key_cache.dtype}, got {key.dtype}",
            TypeError)
    require_contiguous("key", op, key)
    require_dtype("slot_indices", op, slot_indices, (torch.int32,))
    require(slot_indices.dim() == 1 and slot_indices.shape[0] == key.shape[0],
            f"{op}: slot_indices must be 1-D of num_tokens={key.shape[0]}, got {tuple(slot_indices.shape)}")
    slots = slot_indices.long()
    require(bool(((slots >= 0) & (slots < num_blocks * block_size)).all()),
            f"{op}: slot_indices out of the cache's {num_blocks * block_size} slots")
    require(slots.unique().numel() == slots.numel(), f"{op}: slot_indices must not repeat a slot")
    key_cache.view(-1, heads, head_size).index_copy_(0, slots, key)


@operator
def _npu_paged_attention_mla(query: torch.Tensor, key_cache: torch.Tensor, num_kv_heads: int, num_heads: int,
                             scale_value: float, block_table: torch.Tensor, context_lens: torch.Tensor,
                             mla_vheadsize: int, out: torch.Tensor) -> None:
    """Absorbed decode: query row b [num_heads, head_size] over the first ``context_lens[b]`` cached keys of its
    blocks ``block_table[b]``, the values those keys' first ``mla_vheadsize`` numbers; written into ``out``
    [batch, num_heads, mla_vheadsize]."""
    op = "_npu_paged_attention_mla"
    require(key_cache.dim() == 4, f"{op}: key_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_size], "
                                  f"got {tuple(key_cache.shape)}")
    require_dtype("key_cache", op, key_cache, HALF)
    require_contiguous("key_cache", op, key_cache)
    _, block_size, heads, head_size = key_cache.shape
    require(0 < head_size <= MLA_MAX_HEAD_SIZE, f"{op}: head_size must be in (0, {MLA_MAX_HEAD_SIZE}], got "
                                                f"{head_size}")
    require(block_size % 16 == 0 and (head_size <= 256 or block_size <= 128),
            f"{op}: block_size must be a multiple of 16, at most 128 when head_size > 256; got {block_size}")
    require(isinstance(num_kv_heads, int) and num_kv_heads == heads == 1,
            f"{op}: MLA's merged kvCache is MQA only: num_kv_heads and the cache's heads must be 1, got "
            f"{num_kv_heads!r} and {heads}")
    require_dtype("query", op, query, HALF)
    require(isinstance(num_heads, int) and num_heads > 0, f"{op}: num_heads must be a positive int, got "
                                                          f"{num_heads!r}")
    require(query.dim() == 3 and query.shape[1] == num_heads and query.shape[2] == head_size,
            f"{op}: query must be [batch, num_heads={num_heads}, head_size={head_size}], got {tuple(query.shape)}")
    require_contiguous("query", op, query)
    require(key_cache.dtype == query.dtype, f"{op}: key_cache must have query's dtype {query.dtype}, got "
                                            f"{key_cache.dtype}", TypeError)
    require(isinstance(scale_value, float), f"{op}: scale_value must be a float, got {scale_value!r}", TypeError)
    require(isinstance(mla_vheadsize, int) and 0 < mla_vheadsize <= head_size,
            f"{op}: mla_vheadsize must be an int in (0, head_size={head_size}], got {mla_vheadsize!r}")
    batch = query.shape[0]
    require(0 < batch <= MAX_BATCH, f"{op}: batch must be in (0, {MAX_BATCH}], got {batch}")
    require_dtype("block_table", op, block_table, (torch.int32,))
    require(block_table.dim() == 2 and block_table.shape[0] == batch,
            f"{op}: block_table must be [batch={batch}, max_blocks], got {tuple(block_table.shape)}")
    require_dtype("context_lens", op, context_lens, (torch.int32,))
    require(context_lens.device.type == "cpu", f"{op}: context_lens is a host tensor, got {context_lens.device}")
    require(context_lens.shape == (batch,), f"{op}: context_lens must be [batch={batch}], got "
                                            f"{tuple(context_lens.shape)}")
    lens = context_lens.tolist()
    require(all(1 <= n <= block_table.shape[1] * block_size for n in lens),
            f"{op}: context_lens {lens} must be in 1..max_blocks * block_size")
    require(tuple(out.shape) == (batch, num_heads, mla_vheadsize) and out.dtype == query.dtype,
            f"{op}: out must be [batch={batch}, num_heads={num_heads}, mla_vheadsize={mla_vheadsize}] {query.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}")
    for b, n in enumerate(lens):
        blocks = block_table[b, :-(-n // block_size)].long()
        keys = key_cache.index_select(0, blocks).flatten(0, 2)[:n].float()          # [n, head_size]
        scores = (query[b].float() @ keys.t()) * scale_value                           # [num_heads, n]
        out[b] = (scores.softmax(-1) @ keys[:, :mla_vheadsize]).to(out.dtype)
