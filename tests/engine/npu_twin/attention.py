"""TEST-ONLY TWIN of torch-npu's paged-attention operators, on the CPU, in the forms vLLM-Ascend calls them
(``vllm_ascend/attention/attention_v1.py``):

* ``_npu_reshape_and_cache`` and ``_npu_paged_attention``: torch-npu's bindings of the ATB operators
  ReshapeAndCacheOperation and PagedAttentionOperation (CANN "ascend transformer boost" reference): caches
  [num_blocks, block_size, num_kv_heads, head_size] in ND format, int32 slot mapping, block tables and context
  lengths (the context lengths a host tensor), float16/bfloat16 data;
* ``npu_fused_infer_attention_score``: the keyword-only signature of the Ascend Extension for PyTorch API reference
  (7.0.0), in the one form Sluice calls it: ``input_layout="TND"`` over a paged cache (``block_table``, keys and
  values [num_blocks, block_size, num_kv_heads * head_dim]), ``actual_seq_lengths`` the cumulative ends of each
  sequence's queries, ``actual_seq_lengths_kv`` each sequence's key count, and ``sparse_mode=3`` (rightDownCausal)
  or ``sparse_mode=4`` (band, with ``pre_tokens`` / ``next_tokens``: vLLM-Ascend's sliding window) with the
  optimised 2048 x 2048 mask (1 above the diagonal). Other layouts and modes raise "not modelled".

The band (sparse_mode 4), from three sources that agree: the "sparse_mode" page of CANN ops-transformer
(``docs/context/sparse_mode参数说明.md``: band computes what lies between pre_tokens and next_tokens, "the origin is
the bottom-right corner"); the FusedInferAttentionScore reference (``pre_tokens``: how many tokens *before* the query
it attends to, ``next_tokens``: how many after; sparse 4 wants pre_tokens >= -actualSeqLengths, next_tokens >=
-actualSeqLengthsKv, pre_tokens + next_tokens >= 0); and the kernels' mask arithmetic (ops-transformer
``prompt_flash_attention_base.h`` ``GetSparseParam`` / ``ComputeAttenMaskOffset[Pre]``, ``fia_kernel_nonquant_mla.h``
``GetPreNextTokensLeftUp``), which move the origin to the top-left corner (pre - kv + q, next + kv - q) and mask key
j of query row i unless ``i - pre <= j <= i + next``. So query i of a sequence of q queries over kv keys sits at
position ``p = kv - q + i`` and sees keys ``p - pre_tokens .. p + next_tokens``: ``pre_tokens = W - 1``,
``next_tokens = 0`` is a window of W positions, the query's own included. The page's figure for sparse_mode 4
(13 queries, 16 keys, pre_tokens 6, next_tokens 4) shows exactly that; tests/engine/test_npu_twin.py checks
``visible_keys`` against it, transcribed. In sparse_mode 3 pre_tokens and next_tokens are ignored (as documented).

Slots: a negative slot writes nothing (ATB's kernel, ``reshape_and_cache_base.h`` ``CopyToCache`` and
``reshape_and_cache_nd.cpp``: ``if (slotValue < 0) continue``): the padding rows of a captured decode graph use -1,
as vLLM's ``PAD_SLOT_ID``. A slot past the cache is refused.

Workspace: ``_npu_paged_attention`` takes a ``workspace`` (as vLLM-Ascend passes it when capturing a graph), got from
``_npu_paged_attention_get_workspace`` with the same arguments; its size is not modelled.

Block ids: the reference's page-attention constraints say the operator does not check the block ids in blockTable and
the caller must keep them valid, so the twin refuses an id outside the cache in the blocks a sequence's keys span.

The math is float32 softmax attention, cast to the query's dtype at the end.
"""
from __future__ import annotations

import torch

from tests.engine.npu_twin._ops import operator, require, require_contiguous, require_dtype

HALF = (torch.float16, torch.bfloat16)
MASK_SIDE = 2048   # sparse_mode 2/3/4 take this optimised mask, whatever the sequence lengths


def _check_cache(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    require(key_cache.dim() == 4, f"{op}: key_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_size], "
                                  f"got {tuple(key_cache.shape)}")
    require(value_cache.shape == key_cache.shape, f"{op}: value_cache {tuple(value_cache.shape)} must have "
                                                  f"key_cache's shape {tuple(key_cache.shape)}")
    require_dtype("key_cache", op, key_cache, HALF + (torch.int8,))
    require(value_cache.dtype == key_cache.dtype, f"{op}: value_cache must have key_cache's dtype", TypeError)
    require_contiguous("key_cache", op, key_cache)
    require_contiguous("value_cache", op, value_cache)


@operator
def _npu_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """Writes token t's key and value [num_kv_heads, head_size] into slot ``slot_indices[t]`` (block
    ``slot // block_size``, row ``slot % block_size``) of the caches, in place."""
    op = "_npu_reshape_and_cache"
    _check_cache(op, key_cache, value_cache)
    num_blocks, block_size, heads, head_size = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        require(t.dim() == 3 and tuple(t.shape[1:]) == (heads, head_size),
                f"{op}: {name} must be [num_tokens, {heads}, {head_size}] (the cache's heads and head size), got "
                f"{tuple(t.shape)}")
        require(t.dtype == key_cache.dtype, f"{op}: {name} must have the cache's dtype {key_cache.dtype}, got "
                                            f"{t.dtype}", TypeError)
        require_contiguous(name, op, t)
    require(value.shape == key.shape, f"{op}: value {tuple(value.shape)} must have key's shape {tuple(key.shape)}")
    require_dtype("slot_indices", op, slot_indices, (torch.int32,))
    require(slot_indices.dim() == 1 and slot_indices.shape[0] == key.shape[0],
            f"{op}: slot_indices must be 1-D of num_tokens={key.shape[0]}, got {tuple(slot_indices.shape)}")
    slots = slot_indices.long()
    require(bool((slots < num_blocks * block_size).all()), f"{op}: slot_indices past the cache's "
                                                           f"{num_blocks * block_size} slots")
    written = slots >= 0   # a negative slot writes nothing (the kernel skips it)
    key_cache.view(-1, heads, head_size).index_copy_(0, slots[written], key[written])
    value_cache.view(-1, heads, head_size).index_copy_(0, slots[written], value[written])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q [S, Hq, D], keys/values [L, Hkv, D], visible [S, L] or None: float32 attention, [S, Hq, D] float32."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("shd,lhd->hsl", q.float(), k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hsl,lhd->shd", scores.softmax(-1), v)


def _gather(op: str, cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` rows of a sequence's blocks: [length, ...] from a [num_blocks, block_size, ...] cache."""
    num_blocks, block_size = cache.shape[:2]
    blocks = table[:-(-length // block_size)].long()
    require(bool(((blocks >= 0) & (blocks < num_blocks)).all()),
            f"{op}: block_table holds block ids outside the cache's {num_blocks} blocks where the keys lie: "
            f"{blocks.tolist()}")
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


@operator
def _npu_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int,
                         num_heads: int, scale_value: float, block_table: torch.Tensor, context_lens: torch.Tensor,
                         out: torch.Tensor, workspace: torch.Tensor | None = None) -> None:
    """Decode attention: query row b [num_heads, head_size] over the first ``context_lens[b]`` keys of its blocks
    ``block_table[b]``, written into ``out``."""
    lens = _check_paged_attention("_npu_paged_attention", query, key_cache, value_cache, num_kv_heads, num_heads,
                                  scale_value, block_table, context_lens, out)
    require(workspace is None or isinstance(workspace, torch.Tensor),
            f"_npu_paged_attention: workspace must be a tensor (_npu_paged_attention_get_workspace), got "
            f"{workspace!r}", TypeError)
    # All rows at once (the graph twin replays this for every captured layer): each row's first ``lens[b]`` keys of
    # its blocks, the positions past them masked.
    longest = max(lens)
    width = -(-longest // key_cache.shape[1])
    needed = torch.arange(width)[None, :] < torch.tensor([-(-n // key_cache.shape[1]) for n in lens])[:, None]
    blocks = block_table[:, :width].long()
    require(bool(((blocks >= 0) & (blocks < key_cache.shape[0]) | ~needed).all()),
            f"_npu_paged_attention: block_table holds block ids outside the cache's {key_cache.shape[0]} blocks "
            f"where the keys lie: {blocks.tolist()}")
    blocks = blocks.where(needed, 0)
    keys = key_cache[blocks].flatten(1, 2)[:, :longest]        # [batch, longest, kv_heads, head_size]
    values = value_cache[blocks].flatten(1, 2)[:, :longest]
    group = query.shape[1] // key_cache.shape[2]
    scores = torch.einsum("bhd,blhd->bhl", query.float(), keys.float().repeat_interleave(group, dim=2)) * scale_value
    scores = scores.masked_fill(torch.arange(longest)[None, None, :] >= torch.tensor(lens)[:, None, None],
                                float("-inf"))
    attended = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values.float().repeat_interleave(group, dim=2))
    out.copy_(attended.to(out.dtype))


@operator
def _npu_paged_attention_get_workspace(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                       num_kv_heads: int, num_heads: int, scale_value: float,
                                       block_table: torch.Tensor, context_lens: torch.Tensor,
                                       out: torch.Tensor) -> torch.Tensor:
    """The workspace ``_npu_paged_attention`` with these arguments runs in (checked as that operator checks them;
    computed on the host, no task)."""
    _check_paged_attention("_npu_paged_attention_get_workspace", query, key_cache, value_cache, num_kv_heads,
                           num_heads, scale_value, block_table, context_lens, out)
    return torch.empty(1, dtype=torch.uint8, device=query.device)


def _check_paged_attention(op: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                           context_lens: torch.Tensor, out: torch.Tensor) -> list[int]:
    """The documented checks of a paged-attention call; returns the context lengths."""
    _check_cache(op, key_cache, value_cache)
    _, block_size, heads, head_size = key_cache.shape
    require(block_size <= 128, f"{op}: block_size must be at most 128, got {block_size}")
    require_dtype("query", op, query, HALF)
    require(query.dim() == 3 and query.shape[1] == num_heads and query.shape[2] == head_size,
            f"{op}: query must be [batch, num_heads={num_heads}, head_size={head_size}], got {tuple(query.shape)}")
    require_contiguous("query", op, query)
    require(key_cache.dtype == query.dtype, f"{op}: the caches must have query's dtype {query.dtype} (no int8 "
                                            f"dequantisation asked), got {key_cache.dtype}", TypeError)
    require(isinstance(num_kv_heads, int) and num_kv_heads == heads,
            f"{op}: num_kv_heads must be the cache's {heads}, got {num_kv_heads!r}")
    require(isinstance(num_heads, int) and num_heads % num_kv_heads == 0,
            f"{op}: num_heads {num_heads!r} must be a multiple of num_kv_heads {num_kv_heads}")
    require(isinstance(scale_value, float), f"{op}: scale_value must be a float, got {scale_value!r}", TypeError)
    batch = query.shape[0]
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
    require(out.shape == query.shape and out.dtype == query.dtype, f"{op}: out must be like query "
                                                                   f"{tuple(query.shape)} {query.dtype}")
    return lens


def optimised_causal_mask() -> torch.Tensor:
    """The mask sparse_mode 3 documents: [2048, 2048], 1 (masked) above the diagonal."""
    return torch.triu(torch.ones(MASK_SIDE, MASK_SIDE, dtype=torch.bool), diagonal=1)


def visible_keys(sparse_mode: int, q_len: int, kv_len: int, pre_tokens: int, next_tokens: int
                 ) -> torch.Tensor | None:
    """Which keys each of a sequence's queries sees: [q_len, kv_len] booleans, None for all (sparse_mode 0 without a
    mask). Modes 3 and 4 count from the bottom-right corner: query i sits at position ``kv_len - q_len + i``; mode 3
    sees the keys up to it, mode 4 the band ``position - pre_tokens .. position + next_tokens`` (module docstring)."""
    if sparse_mode == 0:
        return None
    position = torch.arange(kv_len - q_len, kv_len)[:, None]
    key = torch.arange(kv_len)[None, :]
    if sparse_mode == 3:
        return key <= position
    return (key >= position - pre_tokens) & (key <= position + next_tokens)


def _int_list(op: str, name: str, value: object, count: int) -> list[int]:
    require(isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value),
            f"{op}: {name} is a list of ints (SymInt[]), got {type(value).__name__}", TypeError)
    assert isinstance(value, (list, tuple))
    require(len(value) == count, f"{op}: {name} must have one entry per sequence ({count}), got {len(value)}")
    return list(value)


@operator
def npu_fused_infer_attention_score(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None, actual_seq_lengths: list[int] | None = None,
        actual_seq_lengths_kv: list[int] | None = None, dequant_scale1: torch.Tensor | None = None,
        quant_scale1: torch.Tensor | None = None, dequant_scale2: torch.Tensor | None = None,
        quant_scale2: torch.Tensor | None = None, quant_offset2: torch.Tensor | None = None,
        antiquant_scale: torch.Tensor | None = None, antiquant_offset: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None, query_padding_size: torch.Tensor | None = None,
        kv_padding_size: torch.Tensor | None = None, key_antiquant_scale: torch.Tensor | None = None,
        key_antiquant_offset: torch.Tensor | None = None, value_antiquant_scale: torch.Tensor | None = None,
        value_antiquant_offset: torch.Tensor | None = None, key_shared_prefix: torch.Tensor | None = None,
        value_shared_prefix: torch.Tensor | None = None, actual_shared_prefix_len: torch.Tensor | None = None,
        query_rope: torch.Tensor | None = None, key_rope: torch.Tensor | None = None,
        key_rope_antiquant_scale: torch.Tensor | None = None, num_heads: int = 1, scale: float = 1.0,
        pre_tokens: int = 2147483647, next_tokens: int = 2147483647, input_layout: str = "BSH",
        num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0,
        antiquant_mode: int = 0, softmax_lse_flag: bool = False, key_antiquant_mode: int = 0,
        value_antiquant_mode: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (attention_out like query, softmax_lse: [1] zeros unless ``softmax_lse_flag``)."""
    op = "npu_fused_infer_attention_score"
    unmodelled = {"pse_shift": pse_shift, "dequant_scale1": dequant_scale1, "quant_scale1": quant_scale1,
                  "dequant_scale2": dequant_scale2, "quant_scale2": quant_scale2, "quant_offset2": quant_offset2,
                  "antiquant_scale": antiquant_scale, "antiquant_offset": antiquant_offset,
                  "query_padding_size": query_padding_size, "kv_padding_size": kv_padding_size,
                  "key_antiquant_scale": key_antiquant_scale, "key_antiquant_offset": key_antiquant_offset,
                  "value_antiquant_scale": value_antiquant_scale, "value_antiquant_offset": value_antiquant_offset,
                  "key_shared_prefix": key_shared_prefix, "value_shared_prefix": value_shared_prefix,
                  "actual_shared_prefix_len": actual_shared_prefix_len, "query_rope": query_rope,
                  "key_rope": key_rope, "key_rope_antiquant_scale": key_rope_antiquant_scale}
    given = [name for name, v in unmodelled.items() if v is not None]
    require(not given, f"{op} twin: {given} (quantisation, padding, shared prefix, MLA rope) are not modelled")
    require(input_layout == "TND" and block_table is not None,
            f"{op} twin: only input_layout='TND' over a paged cache (block_table given) is modelled, got "
            f"{input_layout!r}")
    assert block_table is not None
    require(not softmax_lse_flag and antiquant_mode == key_antiquant_mode == value_antiquant_mode == 0,
            f"{op} twin: softmax_lse_flag and antiquant modes are not modelled")
    require_dtype("query", op, query, HALF)
    require_contiguous("query", op, query)
    require(query.dim() == 3 and query.shape[1] == num_heads,
            f"{op}: TND query must be [T, num_heads={num_heads}, D], got {tuple(query.shape)}")
    head_dim = query.shape[2]
    require(isinstance(num_key_value_heads, int) and num_key_value_heads >= 1 and num_heads % num_key_value_heads == 0,
            f"{op}: num_key_value_heads {num_key_value_heads!r} must divide num_heads {num_heads}")
    for name, t in (("key", key), ("value", value)):
        require(t.dim() == 3 and t.shape[2] == num_key_value_heads * head_dim,
                f"{op}: paged {name} must be [num_blocks, block_size, num_key_value_heads * D = "
                f"{num_key_value_heads * head_dim}], got {tuple(t.shape)}")
        require(t.dtype == query.dtype, f"{op}: {name} must have query's dtype {query.dtype}, got {t.dtype}",
                TypeError)
        require_contiguous(name, op, t)
    require(isinstance(block_size, int) and block_size == key.shape[1] and block_size % 128 == 0,
            f"{op}: block_size must be the cache's block size, a multiple of 128 for float16/bfloat16; got "
            f"{block_size!r} for a cache of {key.shape[1]}")
    require(isinstance(scale, float), f"{op}: scale must be a float, got {scale!r}", TypeError)
    require_dtype("block_table", op, block_table, (torch.int32,))
    require(block_table.dim() == 2, f"{op}: block_table must be 2-D [batch, max_blocks], got "
                                    f"{tuple(block_table.shape)}")
    batch = block_table.shape[0]
    ends = _int_list(op, "actual_seq_lengths", actual_seq_lengths, batch)
    kv_lens = _int_list(op, "actual_seq_lengths_kv", actual_seq_lengths_kv, batch)
    require(all(b > a for a, b in zip([0] + ends, ends)) and ends[-1] == query.shape[0],
            f"{op}: in TND, actual_seq_lengths are the increasing cumulative query ends, the last one T="
            f"{query.shape[0]}; got {ends}")
    require(all(1 <= n <= block_table.shape[1] * block_size for n in kv_lens),
            f"{op}: actual_seq_lengths_kv {kv_lens} must be in 1..max_blocks * block_size")
    require(sparse_mode in (0, 3, 4), f"{op} twin: sparse_mode {sparse_mode} is not modelled (0, 3 or 4)")
    if sparse_mode in (3, 4):
        require(atten_mask is not None and atten_mask.shape == (MASK_SIDE, MASK_SIDE),
                f"{op}: sparse_mode {sparse_mode} takes the optimised [{MASK_SIDE}, {MASK_SIDE}] atten_mask")
        assert atten_mask is not None
        require_dtype("atten_mask", op, atten_mask, (torch.bool, torch.int8, torch.uint8))
        require(torch.equal(atten_mask.bool(), optimised_causal_mask()),
                f"{op}: sparse_mode {sparse_mode}'s atten_mask is 1 above the diagonal and 0 elsewhere")
    else:
        require(atten_mask is None, f"{op} twin: a full atten_mask with sparse_mode 0 is not modelled")
    if sparse_mode == 4:
        for name, v in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
            require(isinstance(v, int), f"{op}: {name} must be an int, got {v!r}", TypeError)
        require(pre_tokens + next_tokens >= 0, f"{op}: in band mode pre_tokens + next_tokens must be >= 0 (the band "
                                               f"must not be empty), got {pre_tokens} and {next_tokens}")
    keys_all = key.view(key.shape[0], block_size, num_key_value_heads, head_dim)
    values_all = value.view(value.shape[0], block_size, num_key_value_heads, head_dim)
    out = torch.empty_like(query)
    start = 0
    for b, (end, kv_len) in enumerate(zip(ends, kv_lens)):
        q_len = end - start
        require(sparse_mode != 3 or kv_len >= q_len,
                f"{op}: sequence {b} has {q_len} queries but {kv_len} keys (rightDownCausal needs kv >= q)")
        require(sparse_mode != 4 or (pre_tokens >= -q_len and next_tokens >= -kv_len),
                f"{op}: band mode needs pre_tokens >= -{q_len} and next_tokens >= -{kv_len} (sequence {b}'s queries "
                f"and keys), got {pre_tokens} and {next_tokens}")
        visible = visible_keys(sparse_mode, q_len, kv_len, pre_tokens, next_tokens)
        require(visible is None or bool(visible.any(dim=1).all()),
                f"{op} twin: sequence {b} has queries that see no key: the operator's invalid-row correction "
                f"(inner_precise bit 1) is not modelled")
        keys = _gather(op, keys_all, block_table[b], kv_len)
        values = _gather(op, values_all, block_table[b], kv_len)
        out[start:end] = _attend(query[start:end], keys, values, visible, scale).to(query.dtype)
        start = end
    return out, torch.zeros(1, dtype=torch.float32)
