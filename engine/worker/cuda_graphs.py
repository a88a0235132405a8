"""The Triton attention backend's part in CUDA graphs of decode steps (``engine.worker.graphs``).

Its decode launch depends on no host value: a captured step reads the slots, block tables and sequence lengths
from the graphs' int64 buffers (a padding row's length 0 reads nothing) and the cumulative query starts from a
buffer of its own, so nothing needs refreshing before a replay. Other CUDA backends read host lengths every step
and run eagerly.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine.worker.graphs import DecodeGraphs


def triton_off_reason(backend: AttentionBackend) -> str | None:
    """Why ``backend`` cannot be captured on CUDA, or None (it is Triton's)."""
    try:   # imported here: without triton the engine still runs (eagerly)
        from engine.attention.triton_backend import TritonAttentionBackend
    except ImportError as e:
        return f"triton is not importable ({e})"
    if not isinstance(backend, TritonAttentionBackend):
        return f"{type(backend).__name__} reads host lengths each step (only the Triton backend is captured)"
    return None


class TritonGraphAttention:
    """Decode metadata over the graphs' int64 buffers; nothing to refresh before a replay."""

    index_dtype = torch.int64

    def __init__(self, backend: AttentionBackend, rows: int, device: torch.device) -> None:
        self.backend = backend
        self.query_start = torch.arange(rows + 1, dtype=torch.int64, device=device)   # one token per row

    def metadata(self, graphs: DecodeGraphs, size: int) -> AttentionMetadata:
        """Views of the buffers (host lengths are not read)."""
        from engine.attention.triton_backend import decode_metadata

        meta = AttentionMetadata(slot_mapping=graphs.slots[:size], block_tables=graphs.block_tables[:size],
                                 seq_lens=graphs.seq_lens[:size], query_lens=[1] * size, seq_lens_host=[0] * size,
                                 num_decodes=size, block_size=graphs.block_size, backend=self.backend)
        decode_metadata(meta, self.query_start[:size + 1])
        return meta

    def before_replay(self, graphs: DecodeGraphs, size: int, meta: AttentionMetadata) -> None:
        """The Triton kernels read every length from the buffers."""
