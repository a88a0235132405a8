"""The CPU attention backend: the PyTorch backend with the compiled kernels in its hot paths."""
from __future__ import annotations

from typing import Any

from engine.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    """``cpu_ops``' paged decode attention (one pass over the blocks in place), its row-copy KV writer, and on
    CPUs with AMX its prefill kernel, on CPUs with AVX512-BF16 but no AMX ``bf16_prefill_attention`` (the same
    operator; ``prefill_kernel=False``: SDPA, ``KernelSettings.amx_prefill``). With
    ``ops`` None (kernels off or not built) it is the PyTorch backend."""

    def __init__(self, ops: Any | None, *, prefill_kernel: bool = True) -> None:
        if ops is None:
            super().__init__()
            return
        prefill = None
        if prefill_kernel and ops.has_amx_attention():
            prefill = ops.paged_prefill_attention
        elif prefill_kernel and ops.has_bf16_attention():
            prefill = ops.bf16_prefill_attention  # the same operator on AVX512-BF16 without AMX
        super().__init__(decode_kernel=ops.paged_decode_attention, kv_writer=ops.write_kv_cache,
                         prefill_kernel=prefill)
