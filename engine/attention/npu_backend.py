"""Paged attention on an Ascend NPU with torch-npu's fused operators, called as vLLM-Ascend calls them
(``vllm_ascend/attention/attention_v1.py``):

* every new token's key and value: ``torch_npu._npu_reshape_and_cache`` into the key and value caches, each
  [num_blocks, 128, num_kv_heads, head_dim] (the default layout's two halves), by int32 slot;
* decodes (the step's first ``num_decodes`` sequences, one token each): ``torch_npu._npu_paged_attention`` over
  int32 block tables and host int32 context lengths;
* prefill chunks, fresh or after cached context (chunked prefill, prefix hits): one
  ``torch_npu.npu_fused_infer_attention_score`` call for all of them, ``input_layout="TND"`` over the paged cache
  (keys and values seen as [num_blocks, 128, num_kv_heads * head_dim]), ``actual_seq_lengths`` the cumulative query
  ends, ``actual_seq_lengths_kv`` each sequence's key count, ``sparse_mode=3`` (right-down causal: query i of a
  chunk of q sees the keys up to kv_len - q + i) with the operator's optimised 2048 x 2048 mask. vLLM-Ascend runs
  fresh prompts through ``_npu_flash_attention`` instead; one call covers both here;
* a sliding-window layer (``window`` W): every row, decodes too, in one ``npu_fused_infer_attention_score`` call as
  above but ``sparse_mode=4`` (band, counted from the bottom-right corner like mode 3) with ``pre_tokens=W - 1`` and
  ``next_tokens=0``: query i sees keys kv_len - q + i - (W - 1) .. kv_len - q + i, its last W positions.
  ``_npu_paged_attention`` takes no window. vLLM-Ascend (``attention_v1.py``) also sends a windowed layer's decodes
  to this operator with sparse_mode 4 and next_tokens 0, but passes ``pre_tokens=sliding_window``; by the operator's
  definition (pre_tokens: the tokens before the query it attends to; the kernels keep keys p - pre_tokens .. p) that
  is a window of W + 1, so here it is W - 1 (tests/engine/npu_twin/attention.py cites the sources).

Soft-capped scores (Gemma 2) are refused at load (engine.worker.model_checks): neither operator takes a cap.

Multi-head latent attention's one-plane latent cache has its own operators (:mod:`engine.attention.npu_mla`).

Not run on Ascend hardware: the calls are checked against a test-only twin written from torch-npu's documentation
(tests/engine/npu_twin). The operators take float16 or bfloat16 queries and a cache of the same dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, StepLayout
from engine.attention.npu_mla import NpuLatentAttention

# The block size the operators are run with (vLLM-Ascend's; npu_fused_infer_attention_score takes multiples of 128
# for float16/bfloat16 paged caches, _npu_paged_attention at most 128).
NPU_BLOCK_SIZE = 128
# sparse_mode 3 reads this fixed mask (1 above the diagonal), whatever the sequence lengths.
MASK_SIDE = 2048


@dataclass
class NpuAttentionMetadata(AttentionMetadata):
    """The default metadata plus what the operators read, in their dtypes (built once per step)."""

    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0))                # int32 [num_tokens]
    block_table: torch.Tensor = field(default_factory=lambda: torch.empty(0))          # int32 [num_seqs, max]
    decode_block_table: torch.Tensor = field(default_factory=lambda: torch.empty(0))   # block_table[:num_decodes]
    decode_context_lens: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # int32 [num_decodes], host
    prefill_block_table: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # block_table[num_decodes:]
    query_ends: list[int] = field(default_factory=list)           # cumulative query lengths of every row
    kv_lens: list[int] = field(default_factory=list)              # keys each row attends over
    prefill_query_ends: list[int] = field(default_factory=list)   # cumulative query lengths of the prefills
    prefill_kv_lens: list[int] = field(default_factory=list)      # keys each prefill chunk attends over
    mask: torch.Tensor | None = None                               # the optimised causal mask, on the device


class NpuAttentionBackend(AttentionBackend):
    """``ops``: the ``torch_npu`` module (the NPU device hands it over)."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._latent = NpuLatentAttention(ops)

    def latent_attention(self) -> NpuLatentAttention:
        """The latent cache through torch-npu's MLA operators (:mod:`engine.attention.npu_mla`), in the 128-token
        blocks of :meth:`kv_cache_shape` (one plane: ``planes`` 1)."""
        return self._latent

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       planes: int = 2) -> tuple[int, ...]:
        if block_size != NPU_BLOCK_SIZE:
            raise ValueError(f"block_size: the NPU attention operators run blocks of {NPU_BLOCK_SIZE}, "
                             f"got {block_size}")
        return super().kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, planes)

    def _mask(self, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(device)
        if mask is None:
            mask = torch.triu(torch.ones(MASK_SIDE, MASK_SIDE, dtype=torch.bool), diagonal=1).to(device)
            self._masks[device] = mask
        return mask

    def build_metadata(self, layout: StepLayout, device: torch.device) -> NpuAttentionMetadata:
        base = super().build_metadata(layout, device)
        nd = layout.num_decodes
        num_tokens = sum(layout.query_lens)
        # A block given back behind every window (engine.core.block_manager.RELEASED, -1) reads as block 0, as
        # vLLM's null block: the operators take real block ids, and no band reaches those positions.
        tables = np.maximum(layout.block_tables, 0).astype(np.int32)
        table = torch.from_numpy(tables).to(device, non_blocking=True)
        prefill_lens = layout.query_lens[nd:]
        return NpuAttentionMetadata(
            **vars(base),
            slots=layout.slot_mapping[:num_tokens].to(torch.int32).to(device, non_blocking=True),
            block_table=table,
            decode_block_table=table[:nd],
            decode_context_lens=torch.tensor(layout.seq_lens[:nd], dtype=torch.int32),
            prefill_block_table=table[nd:],
            query_ends=np.cumsum(layout.query_lens).tolist(),
            kv_lens=list(layout.seq_lens),
            prefill_query_ends=np.cumsum(prefill_lens).tolist() if prefill_lens else [],
            prefill_kv_lens=list(layout.seq_lens[nd:]),
            mask=self._mask(device),   # prefills, and a windowed layer's decodes
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        assert isinstance(meta, NpuAttentionMetadata), "NpuAttentionBackend reads the metadata it builds"
        if softcap is not None:   # refused at load (engine.worker.model_checks)
            raise ValueError("soft-capped attention scores are not wired to the NPU's operators (none takes a cap)")
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        num_heads = query.shape[1]
        # The operators take ND-format (contiguous) tensors; q, k and v are views of the fused projection.
        query = query.contiguous()
        self.ops._npu_reshape_and_cache(key=key.contiguous(), value=value.contiguous(), key_cache=key_cache,
                                        value_cache=value_cache, slot_indices=meta.slots)
        paged_keys = key_cache.view(num_blocks, block_size, num_kv_heads * head_dim)
        paged_values = value_cache.view(num_blocks, block_size, num_kv_heads * head_dim)
        if window is not None:   # every row in one band call (see the module's docstring)
            out, _ = self.ops.npu_fused_infer_attention_score(
                query, paged_keys, paged_values, atten_mask=meta.mask, block_table=meta.block_table,
                input_layout="TND", block_size=block_size, actual_seq_lengths=meta.query_ends,
                actual_seq_lengths_kv=meta.kv_lens, num_key_value_heads=num_kv_heads, num_heads=num_heads,
                scale=float(scale), sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
            return out
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd > 0:
            self.paged_decode(query[:nd], key_cache, value_cache, meta, float(scale), out[:nd])
        if meta.prefill_query_ends:
            prefill_out, _ = self.ops.npu_fused_infer_attention_score(
                query[nd:], paged_keys, paged_values, atten_mask=meta.mask, block_table=meta.prefill_block_table,
                input_layout="TND", block_size=block_size, actual_seq_lengths=meta.prefill_query_ends,
                actual_seq_lengths_kv=meta.prefill_kv_lens, num_key_value_heads=num_kv_heads, num_heads=num_heads,
                scale=float(scale), sparse_mode=3)
            out[nd:] = prefill_out
        return out

    def paged_decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: NpuAttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """The decodes' attention into ``out``: ``_npu_paged_attention`` over int32 block tables and host context
        lengths (a decode graph's backend, ``engine.worker.npu_graphs``, captures it so its lengths can be updated)."""
        self.ops._npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache,
                                      num_kv_heads=key_cache.shape[2], num_heads=query.shape[1], scale_value=scale,
                                      block_table=meta.decode_block_table, context_lens=meta.decode_context_lens,
                                      out=out)
