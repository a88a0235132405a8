"""What every attention backend owns: the cache's layout and allocation, block copies, the step's metadata."""
from __future__ import annotations

import numpy as np
import torch

from engine.attention.backend import StepLayout, kv_cache_shape
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.device import CpuDevice
from engine.kernels import cpu_ops


def test_caches_are_allocated_zeroed_in_the_backends_layout() -> None:
    backend = TorchAttentionBackend()
    caches = backend.allocate_kv_caches(CpuDevice(), 3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8,
                                        dtype=torch.bfloat16)
    assert len(caches) == 3 and len({c.data_ptr() for c in caches}) == 3
    assert all(c.shape == kv_cache_shape(5, 4, 2, 8) == (2, 5, 4, 2, 8) for c in caches)
    assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)


def test_copy_blocks_copies_keys_and_values_in_every_layer() -> None:
    backend = TorchAttentionBackend()
    caches = [torch.randn(kv_cache_shape(6, 2, 1, 4)) for _ in range(2)]
    before = [c.clone() for c in caches]
    backend.copy_blocks(caches, [(1, 4), (2, 5)])
    for c, b in zip(caches, before):
        torch.testing.assert_close(c[:, 4], b[:, 1], rtol=0, atol=0)
        torch.testing.assert_close(c[:, 5], b[:, 2], rtol=0, atol=0)
        torch.testing.assert_close(c[:, :4], b[:, :4], rtol=0, atol=0)


def test_metadata_is_the_layout_on_the_device() -> None:
    slots = torch.arange(100, dtype=torch.int64)  # a staging buffer longer than the step
    tables = np.array([[3, 0], [1, 2]], dtype=np.int64)
    layout = StepLayout(slot_mapping=slots, block_tables=tables, query_lens=[1, 3], seq_lens=[5, 7],
                        num_decodes=1, block_size=4)
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(layout, torch.device("cpu"))
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3]  # one slot per new token
    assert meta.block_tables.tolist() == [[3, 0], [1, 2]] and meta.seq_lens.tolist() == [5, 7]
    assert (meta.query_lens, meta.seq_lens_host, meta.num_decodes, meta.block_size) == ([1, 3], [5, 7], 1, 4)
    assert meta.backend is backend and meta.num_seqs == 2


def test_cpu_backend_takes_the_kernels_it_is_given() -> None:
    assert CpuAttentionBackend(None).decode_kernel is None  # kernels off or not built: the PyTorch backend
    ops = cpu_ops()
    assert ops is not None
    backend = CpuAttentionBackend(ops)
    assert backend.decode_kernel is ops.paged_decode_attention and backend.kv_writer is ops.write_kv_cache
    if ops.has_amx_attention():
        assert backend.prefill_kernel is ops.paged_prefill_attention
    elif ops.has_bf16_attention():  # AVX512-BF16 without AMX
        assert backend.prefill_kernel is ops.bf16_prefill_attention
    else:
        assert backend.prefill_kernel is None
    assert CpuAttentionBackend(ops, prefill_kernel=False).prefill_kernel is None  # SLUICE_AMX_PREFILL=0
