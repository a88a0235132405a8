"""The CUDA attention backend: Triton kernels (``engine.kernels.triton_paged``) over the default paged layout.

One KV-write launch and one attention launch per layer for the whole step, decodes and prefill chunks (with or
without cached context) alike, reading the cache in place. What the kernels need besides the default metadata
(each sequence's first token in the flat batch, the longest chunk) is built once per step in ``build_metadata``,
so ``forward`` makes no host-to-device copy and no host read: a decode step over fixed-size buffers can be
captured in a CUDA graph (``engine.worker.cuda_graphs``).
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, StepLayout
from engine.attention.torch_backend import windowed_attention
from engine.kernels import triton_paged

# Keys of AttentionMetadata.derived this backend fills in build_metadata.
QUERY_START = "triton.query_start"   # int64 [num_seqs + 1] on the device
MAX_QUERY_LEN = "triton.max_query_len"   # int, host


def decode_metadata(meta: AttentionMetadata, query_start: torch.Tensor) -> None:
    """Marks ``meta`` as a decode step (one token per sequence) whose flat offsets are ``query_start``
    (``arange(num_seqs + 1)`` on the device): what a captured graph's fixed metadata carries."""
    meta.derived[QUERY_START] = query_start
    meta.derived[MAX_QUERY_LEN] = 1


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels; float16, bfloat16 and float32 (a KV cache dtype of its own
    is read and converted to the query's)."""

    def build_metadata(self, layout: StepLayout, device: torch.device) -> AttentionMetadata:
        meta = super().build_metadata(layout, device)
        starts = [0]
        for n in layout.query_lens:
            starts.append(starts[-1] + n)
        meta.derived[QUERY_START] = torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True)
        meta.derived[MAX_QUERY_LEN] = max(layout.query_lens, default=0)
        return meta

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        triton_paged.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if softcap is not None or (window is not None and max(meta.seq_lens_host) > window):
            # the kernels have no window nor soft-capping: the PyTorch path (its gather reads the window's blocks)
            return windowed_attention(query, kv_cache, meta, scale, window, softcap)
        query_start = meta.derived[QUERY_START]
        max_query_len = meta.derived[MAX_QUERY_LEN]
        assert isinstance(query_start, torch.Tensor) and isinstance(max_query_len, int)
        return triton_paged.paged_attention(query, kv_cache, meta.block_tables, query_start, meta.seq_lens,
                                            max_query_len, scale)
