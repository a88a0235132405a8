"""Paged attention in Triton: the KV write by slot mapping and one attention kernel for decodes and prefill chunks,
reading the default cache layout ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` in place (no gather).

One program takes one sequence, one KV head and a tile of that sequence's query tokens. Its rows are (token, query
head of the KV head's group) pairs, so a decode's whole GQA group shares one pass over the keys and a tensor-core
``tl.dot`` of at least 16 rows. The keys are walked ``BLOCK_N`` positions at a time, each position's page looked
up in the block table; softmax is online (flash attention), in float32. A chunk of ``q`` query tokens ending at
``seq_len`` sits at ``seq_len - q``..``seq_len - 1`` and sees the keys up to its own position, so decodes (``q``
is 1), fresh prompts and chunks after cached context are the same code.

Every shape the launch depends on is fixed by the tensors' sizes, and the lengths are read on the device, so a
decode launch over fixed-size buffers is CUDA-graph safe. Rows with ``seq_len`` 0 (a captured graph's padding)
read nothing and return zeros; a negative slot is not written.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels run on CPU tensors with
numpy: that is how they are tested without a GPU. A leaf module: imports nothing of the engine.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Rows (token x query head) of a decode program, at least: tl.dot takes 16-row tiles.
_MIN_ROWS = 16
# Rows of a prefill program, and keys per step of the inner loop.
_PREFILL_ROWS = 64
_BLOCK_N = 32
_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c2, stride_cb, stride_co, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # The slot test broadcast through a tensor: the interpreter refuses a mask built from a scalar comparison.
    ok = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (h[:, None] * 0 + slot >= 0)
    page = tl.where(slot >= 0, slot // PAGE, 0)
    dst = cache_ptr + page * stride_cb + (slot % PAGE) * stride_co + h[:, None] * stride_ch + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok, other=0.0)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + stride_c2, v.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _paged_attention_kernel(q_ptr, cache_ptr, out_ptr, tables_ptr, query_start_ptr, seq_lens_ptr, scale_log2,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_c2, stride_cb, stride_co, stride_ch, stride_bt,
                            HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                            BLOCK_M: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context = seq_len - q_len
    first = tile * TOKENS
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (token < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + token
    # The keys this tile sees: up to its last token's position (none for a tile past the sequence's tokens).
    kv_end = tl.where(first < q_len, context + tl.minimum(first + TOKENS, q_len), 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_ch
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        page = tl.load(tables_ptr + seq * stride_bt + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        offs = page * stride_cb + (pos % PAGE) * stride_co
        kt = tl.load(k_base + offs[None, :] + d[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, kt.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, kt.to(q.dtype))
        s = s * scale_log2
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that has seen no key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(k_base + stride_c2 + offs[:, None] + d[None, :], mask=pos_ok[:, None] & d_ok[None, :],
                    other=0.0)
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous (2, num_blocks, block_size, num_kv_heads, head_dim) tensor, "
                         f"got shape {tuple(kv_cache.shape)}")


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [T, Hkv, D] into their slots (``block_id * block_size + offset``; negative: skipped)."""
    _check_cache(kv_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, page, num_kv_heads, head_dim = kv_cache.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=page, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim))


def tile_rows(group: int, max_query_len: int) -> int:
    """Rows of one program: the whole GQA group of one token for decodes (padded to 16), 64 for prefills
    (or one group, when a group is larger)."""
    rows = _MIN_ROWS if max_query_len == 1 else _PREFILL_ROWS
    return max(rows, triton.next_power_of_2(group))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D], sequence i's tokens at ``query_start[i]:query_start[i + 1]`` (int, [S + 1], on the
    device); ``seq_lens`` [S]: tokens in the cache after this step, these included; ``block_tables`` [S, W];
    ``max_query_len``: the longest sequence's new tokens (a host number: it sizes the launch grid). Each token
    attends causally over its sequence's cached context and itself. Returns [T, Hq, D] (``out`` when given)."""
    _check_cache(kv_cache)
    num_tokens, num_heads, head_dim = query.shape
    _, _, page, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} x {head_dim} do not fit the cache's {num_kv_heads} x {cache_dim}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    rows = tile_rows(group, max_query_len)
    tokens = rows // group   # query tokens per program
    tiles = math.ceil(max_query_len / tokens)
    _paged_attention_kernel[(num_seqs, num_kv_heads, tiles)](
        query, kv_cache, out, block_tables, query_start, seq_lens, scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, PAGE=page, BLOCK_M=rows, TOKENS=tokens, BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), IEEE=query.dtype == torch.float32)
    return out
