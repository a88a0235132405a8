"""Paged attention in plain PyTorch: ``scaled_dot_product_attention`` plus a block-table gather (any device)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata

# The longest prefill chunk after cached context that the decode kernel runs token by token (see _by_rows).
ROWS_MAX_QUERY = 512

if TYPE_CHECKING:
    from engine.kernels import KVWriter, PagedDecodeAttention, PagedPrefillAttention


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatters the new tokens' keys and values into their slots (reshape-and-cache)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first ``num_blocks`` blocks of each row of ``block_tables``:
    two tensors of shape [num_rows, num_blocks * block_size, Hkv, D]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    ids = block_tables[:, :num_blocks]
    rows = ids.shape[0]
    flat = ids.reshape(-1)  # index_select copies whole blocks: about twice as fast as advanced indexing on CPU
    keys = kv_cache[0].index_select(0, flat).view(rows, num_blocks * block_size, num_kv_heads, head_dim)
    values = kv_cache[1].index_select(0, flat).view(rows, num_blocks * block_size, num_kv_heads, head_dim)
    return keys, values


def _window_blocks(block_tables: torch.Tensor, first: torch.Tensor, count: int, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row, ``count`` consecutive entries of its block table from the block holding position ``first[row]``
    (past the table's end: block 0, masked by the caller), and the position of each gathered slot's first block."""
    start = first // block_size
    idx = (start[:, None] + torch.arange(count, device=first.device)[None, :]).clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, idx), start * block_size


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """query [..., Hq, Q, D] over keys / values [..., Hkv, S, D] under a boolean ``mask`` (True: seen); with
    ``softcap``, scores are soft-capped (``tanh(s / c) * c``) before the softmax, as Gemma 2 does (SDPA cannot)."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = query.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype), values)


def windowed_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       window: int | None, softcap: float | None = None, skip_decodes: bool = False) -> torch.Tensor:
    """Attention over the paged cache (the step's keys and values already written) for what the fast paths do not
    run: a sliding window (each query at position p sees keys p - window + 1 .. p; only the blocks that hold a row's
    window are gathered, so a step costs the window, not the context) and soft-capped scores. query [T, Hq, D] ->
    [T, Hq, D], in the step's row order (``skip_decodes``: the prefill rows only)."""
    bs = meta.block_size
    outputs: list[torch.Tensor] = []
    nd = meta.num_decodes
    device = query.device
    if nd and not skip_decodes:
        seq_lens = meta.seq_lens[:nd]
        if window is None:
            count = -(-max(meta.seq_lens_host[:nd]) // bs)
            first = torch.zeros_like(seq_lens)
        else:
            count = -(-window // bs) + 1
            first = (seq_lens - window).clamp(min=0)
        tables, base = _window_blocks(meta.block_tables[:nd], first, count, bs)
        keys, values = gather_kv(kv_cache, tables, count)
        positions = base[:, None] + torch.arange(count * bs, device=device)[None, :]
        mask = (positions >= first[:, None]) & (positions < seq_lens[:, None])
        out = _attend(query[:nd].unsqueeze(2), keys.to(query.dtype).transpose(1, 2),
                      values.to(query.dtype).transpose(1, 2), mask[:, None, None, :], scale, softcap)
        outputs.append(out.squeeze(2))
    start = nd
    for i in range(nd, meta.num_seqs):
        q_len, seq_len = meta.query_lens[i], meta.seq_lens_host[i]
        end = start + q_len
        first_key = 0 if window is None else max(0, seq_len - q_len - window + 1)
        count = -(-(seq_len - (first_key // bs) * bs) // bs)
        tables, base = _window_blocks(meta.block_tables[i:i + 1],
                                      torch.tensor([first_key], device=meta.block_tables.device), count, bs)
        keys, values = gather_kv(kv_cache, tables, count)
        k_pos = int(base[0]) + torch.arange(count * bs, device=device)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        out = _attend(query[start:end].transpose(0, 1)[None], keys[0].to(query.dtype).transpose(0, 1)[None],
                      values[0].to(query.dtype).transpose(0, 1)[None], mask, scale, softcap)
        outputs.append(out[0].transpose(0, 1))
        start = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch (``scaled_dot_product_attention`` plus a block-table gather),
    used by the cpu and cuda device backends.

    Decodes are batched: one gather of every decode sequence's cached K/V and one SDPA call with a
    length mask. Prefill chunks run one SDPA call each, causal with the query offset
    ``seq_len - query_len`` (SDPA's own ``is_causal`` aligns the diagonal top-left, which is only
    right when there is no earlier context).

    ``decode_kernel`` (``CpuAttentionBackend`` passes ``cpu_ops.paged_decode_attention``) replaces the
    gather + SDPA of float32 and bfloat16 decodes (over a float32, float16 or bfloat16 cache) with one pass over
    the blocks in place, and runs prefill chunks after cached context (up to ``ROWS_MAX_QUERY`` tokens) with a
    decode row per token, where no prefill kernel takes them; ``kv_writer`` (``cpu_ops.write_kv_cache``)
    replaces ``write_kv_cache``'s two ``index_copy_`` calls with row copies when keys and values already have
    the cache's dtype; ``prefill_kernel``
    (``cpu_ops.paged_prefill_attention`` on CPUs with AMX, ``bf16_prefill_attention`` on AVX512-BF16 without it)
    runs every prefill sequence of a step, with or
    without cached context, in one call over the cache when query and cache are bfloat16 and blocks hold whole
    16-row tiles.
    """

    def __init__(self, decode_kernel: PagedDecodeAttention | None = None, kv_writer: KVWriter | None = None,
                 prefill_kernel: PagedPrefillAttention | None = None) -> None:
        self.decode_kernel = decode_kernel
        self.kv_writer = kv_writer
        self.prefill_kernel = prefill_kernel

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if (self.kv_writer is not None and key.dtype == kv_cache.dtype == value.dtype and kv_cache.is_contiguous()
                and key.stride(-1) == value.stride(-1) == 1 and key.stride(-2) == value.stride(-2) == key.shape[-1]):
            self.kv_writer(key, value, kv_cache, meta.slot_mapping)
        else:
            write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if softcap is not None or (window is not None and max(meta.seq_lens_host) > window):
            # Soft-capped scores, or some query sees past its window: the explicit path; but windowed decodes on
            # the decode kernel, which starts each sequence at its window's first key (a windowed step then costs
            # the window, not the context: 32 x 8k-token sequences, 1k window: see docs/benchmarks.md).
            nd = meta.num_decodes
            if softcap is not None or window is None or not nd or not self._rows_take(query, kv_cache):
                return windowed_attention(query, kv_cache, meta, scale, window, softcap)
            assert self.decode_kernel is not None
            seq_lens = meta.seq_lens[:nd].contiguous()
            decodes = self.decode_kernel(query[:nd].contiguous(), kv_cache, meta.block_tables[:nd].contiguous(),
                                         seq_lens, scale, (seq_lens - window).clamp_(min=0))
            if nd == meta.num_seqs:
                return decodes
            return torch.cat([decodes, windowed_attention(query, kv_cache, meta, scale, window, skip_decodes=True)])
        outputs: list[torch.Tensor] = []
        if meta.num_decodes > 0:
            outputs.append(self._decode(query[:meta.num_decodes], kv_cache, meta, scale))
        if meta.num_seqs > meta.num_decodes and self._prefill_kernel_takes(query, kv_cache, meta):
            assert self.prefill_kernel is not None
            first = meta.num_decodes
            starts = [0]
            for n in meta.query_lens[first:]:
                starts.append(starts[-1] + n)
            outputs.append(self.prefill_kernel(
                query[first:].contiguous(), kv_cache, meta.block_tables[first:].contiguous(),
                torch.tensor(starts, dtype=torch.int64), meta.seq_lens[first:].contiguous(), scale))
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        start, i = meta.num_decodes, meta.num_decodes
        rows = self._rows_take(query, kv_cache)
        while i < meta.num_seqs:
            if rows and self._by_rows(meta, i):
                # Chunks after cached context, side by side: one decode-kernel call over all their tokens.
                j = i + 1
                while j < meta.num_seqs and self._by_rows(meta, j):
                    j += 1
                end = start + sum(meta.query_lens[i:j])
                outputs.append(self._context_prefills(query[start:end], kv_cache, meta, i, j, scale))
                start, i = end, j
                continue
            # Fresh prompts of one length side by side (a wave of equal requests): one SDPA call for all of them
            # (32 x 128 tokens: 4.0 -> 2.7 ms per layer in bfloat16) instead of one each.
            length, j = meta.query_lens[i], i + 1
            if meta.seq_lens_host[i] == length:  # fresh: nothing cached before this prompt
                while j < meta.num_seqs and meta.query_lens[j] == length and meta.seq_lens_host[j] == length:
                    j += 1
            end = start + (j - i) * length
            if j - i > 1:
                outputs.append(self._fresh_prefills(query[start:end], key[start:end], value[start:end], kv_cache,
                                                    j - i, scale))
            else:
                outputs.append(self._prefill(query[start:end], key[start:end], value[start:end], kv_cache, meta, i,
                                             scale))
            start, i = end, j
        if len(outputs) == 1:
            return outputs[0]
        return torch.cat(outputs, dim=0)

    def _prefill_kernel_takes(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the prefill kernel runs this step's prefills: bfloat16 query and cache, blocks of whole 16-row
        tiles, head_dim a multiple of 32 up to 128. Per layer against SDPA on contiguous keys (bfloat16, 9/3 heads
        of 64, 2 Sapphire Rapids-class cores): 1.6-1.9x faster from 16 prompts x 32 tokens to 32 x 128, 2.1-2.3x
        at 512 tokens, 1.4x at 4096 (docs/cpu-kernels.md, "Prefill attention on AMX tiles"); chunks after cached
        context skip the block gather and the masked SDPA call."""
        head_dim = query.shape[-1]
        return (self.prefill_kernel is not None and query.dtype == kv_cache.dtype == torch.bfloat16
                and query.device.type == "cpu" and kv_cache.is_contiguous() and meta.block_size % 16 == 0
                and head_dim % 32 == 0 and head_dim <= 128)

    def _rows_take(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the decode kernel runs this step's prefill chunks after cached context, token by token (see
        ``_context_prefills``): the dtypes it reads, a contiguous cache."""
        return (self.decode_kernel is not None and query.dtype in (torch.float32, torch.bfloat16)
                and kv_cache.dtype in (torch.float32, torch.float16, torch.bfloat16) and kv_cache.is_contiguous())

    @staticmethod
    def _by_rows(meta: AttentionMetadata, i: int) -> bool:
        """Sequence ``i`` is a chunk after cached context short enough for decode rows: past
        ``ROWS_MAX_QUERY`` new tokens SDPA's matrix products over the gathered keys win (1 x (2048 after 2048):
        507 vs 614 ms on one core)."""
        return meta.seq_lens_host[i] > meta.query_lens[i] and meta.query_lens[i] <= ROWS_MAX_QUERY

    def _context_prefills(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, first: int,
                          stop: int, scale: float) -> torch.Tensor:
        """Prefill chunks of sequences ``first``..``stop - 1`` that follow cached context (this step's keys and
        values already written): each new token is a decode row of its own, with its sequence's block table
        and the keys up to its position, so the kernel reads the context in place from the paged cache.

        Against a block gather plus a masked SDPA call per sequence (what ``_prefill`` does), per layer of
        the default model's shape, bfloat16, 16 chunks of 128 tokens after 1024 cached (the shared-prefix
        workload): 101 vs 95 ms on one core, 125 vs 752 ms on two cores shared with other processes (the
        kernel's threads take work from a shared counter; the masked SDPA's fixed shares wait on a
        preempted thread); 4 x (512 after 256): 78 vs 87 ms on one core, 91 vs 252 on two
        (benchmarks/context_prefill.py)."""
        key = ("context_rows", first, stop)
        derived = meta.derived.get(key)
        if derived is None:
            lens = meta.query_lens[first:stop]
            ends = meta.seq_lens_host[first:stop]
            device = query.device
            counts = torch.tensor(lens, dtype=torch.int64, device=device)
            max_blocks = -(-max(ends) // meta.block_size)
            tables = meta.block_tables[first:stop, :max_blocks].repeat_interleave(counts, dim=0).contiguous()
            # Token i of a chunk of q ending at seq_len sits at seq_len - q + i and sees that many keys plus one.
            positions = torch.cat([torch.arange(end - q + 1, end + 1, dtype=torch.int64, device=device)
                                   for q, end in zip(lens, ends)])
            derived = meta.derived[key] = (tables, positions)
        tables, positions = derived  # type: ignore[misc]
        assert self.decode_kernel is not None
        return self.decode_kernel(query.contiguous(), kv_cache, tables, positions, scale)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        num_decodes = meta.num_decodes
        if (self.decode_kernel is not None and query.dtype in (torch.float32, torch.bfloat16)
                and kv_cache.dtype in (torch.float32, torch.float16, torch.bfloat16) and kv_cache.is_contiguous()):
            return self.decode_kernel(query.contiguous(), kv_cache, meta.block_tables[:num_decodes].contiguous(),
                                      meta.seq_lens[:num_decodes].contiguous(), scale)
        block_size = meta.block_size
        max_len = max(meta.seq_lens_host[:num_decodes])
        num_blocks = -(-max_len // block_size)
        keys, values = gather_kv(kv_cache, meta.block_tables[:num_decodes], num_blocks)
        keys, values = keys.to(query.dtype), values.to(query.dtype)  # a KV cache dtype of its own
        # Slots past a sequence's length hold stale or foreign data: mask them out.
        positions = torch.arange(num_blocks * block_size, device=query.device)
        mask = positions[None, :] < meta.seq_lens[:num_decodes, None]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [N, Hq, 1, D]
            keys.transpose(1, 2),  # [N, Hkv, L, D]
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _fresh_prefills(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        count: int, scale: float) -> torch.Tensor:
        """``count`` prompts of one length with nothing cached before them, their tokens one after another:
        causal attention over each prompt's own keys, as one batched SDPA call."""
        if kv_cache.dtype != key.dtype:  # as rounded in the cache (see _prefill)
            key, value = key.to(kv_cache.dtype).to(key.dtype), value.to(kv_cache.dtype).to(value.dtype)
        length = query.shape[0] // count

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [count * L, H, D] -> [count, H, L, D]
            return x.reshape(count, length, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads_first(query), heads_first(key), heads_first(value), is_causal=True,
                                             scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(query.shape)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, seq_index: int, scale: float) -> torch.Tensor:
        query_len = query.shape[0]
        seq_len = meta.seq_lens_host[seq_index]
        context_len = seq_len - query_len
        # 4-D (batch of one): SDPA's fused CPU kernel needs it; 3-D falls back to the math path,
        # 1.7x slower at 128 tokens and 4.5x at 2048 here.
        q = query.transpose(0, 1)  # [Hq, Q, D]
        if context_len == 0:
            # Nothing cached before this chunk: attend over the new keys directly, no gather. With a KV cache
            # dtype of its own (float16), as rounded there: a prompt then gets the same attention inputs
            # whether it is prefilled in one chunk or several (later chunks read the cache).
            if kv_cache.dtype != key.dtype:
                key, value = key.to(kv_cache.dtype).to(key.dtype), value.to(kv_cache.dtype).to(value.dtype)
            out = F.scaled_dot_product_attention(
                q[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], is_causal=True, scale=scale,
                enable_gqa=True)
            return out[0].transpose(0, 1)
        num_blocks = -(-seq_len // meta.block_size)
        keys, values = gather_kv(kv_cache, meta.block_tables[seq_index:seq_index + 1], num_blocks)
        keys = keys[0, :seq_len].transpose(0, 1).to(query.dtype)  # [Hkv, S, D]
        values = values[0, :seq_len].transpose(0, 1).to(query.dtype)
        # Query i sits at position context_len + i and sees keys 0..context_len + i.
        q_pos = torch.arange(context_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
