"""NpuLatentAttention on the torch-npu operator twin against the PyTorch LatentAttention, on the NPU backend's own
metadata: the same latent cache writes and the same absorbed decode (half-precision tolerance) over 128-token blocks
handed out out of order, in float16 and bfloat16, at DeepSeek-V3's latent width (512 + 64)."""
from __future__ import annotations

import pytest
import torch

from engine.attention.mla import LatentAttention
from engine.attention.npu_backend import NpuAttentionBackend
from engine.attention.npu_mla import NpuLatentAttention
from tests.engine.attention.test_npu_backend import BLOCK, Sequences
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)

HEADS, KV_LORA_RANK, ROPE = 4, 512, 64
LATENT = KV_LORA_RANK + ROPE
SCALE = 192 ** -0.5   # DeepSeek-V3's qk_head_dim (128 + 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_latent_ops_match_the_torch_ops(dtype: torch.dtype) -> None:
    backend = NpuAttentionBackend(twin)
    npu_ops, ref_ops = backend.latent_attention(), LatentAttention()
    assert isinstance(npu_ops, NpuLatentAttention)
    num_blocks = 8
    gen = torch.Generator().manual_seed(0)
    # Garbage, not zeros: a read of a slot never written shows up.
    cache = torch.randn(backend.kv_cache_shape(num_blocks, BLOCK, 1, LATENT, planes=1), generator=gen).to(dtype)
    npu_cache, ref_cache = cache.clone(), cache.clone()
    seqs = Sequences(num_blocks)
    steps = [([("a", 5), ("b", 130)], 0),              # fresh prefills, one over two blocks
             ([("b", 1), ("a", 140)], 1),              # a decode beside a chunk after 5 cached tokens
             ([("a", 1), ("b", 1), ("c", 3)], 2)]      # decodes beside a new prompt
    decoded = 0
    for chunks, num_decodes in steps:
        meta = backend.build_metadata(seqs.layout(chunks, num_decodes), torch.device("cpu"))
        latent = torch.randn(sum(n for _, n in chunks), LATENT, generator=gen).to(dtype)
        npu_ops.write(latent, npu_cache, meta)
        ref_ops.write(latent, ref_cache, meta)
        assert torch.equal(npu_cache, ref_cache)   # the same slots written with the same values
        for i in range(num_decodes, meta.num_seqs):   # what the prefill chunks read back
            assert torch.equal(npu_ops.sequence_latents(npu_cache, meta, i),
                               ref_ops.sequence_latents(ref_cache, meta, i))
        if num_decodes:
            query = (torch.randn(num_decodes, HEADS, LATENT, generator=gen) * 2).to(dtype)
            got = npu_ops.decode(query, npu_cache, meta, KV_LORA_RANK, SCALE)
            expected = ref_ops.decode(query, ref_cache, meta, KV_LORA_RANK, SCALE)
            assert got.shape == (num_decodes, HEADS, KV_LORA_RANK) and got.dtype == dtype
            torch.testing.assert_close(got, expected, atol=2e-2 if dtype == torch.bfloat16 else 2e-3, rtol=1e-2)
            decoded += num_decodes
    assert decoded == 3
    assert twin.CALLED == {"_npu_reshape_and_cache_siso", "_npu_paged_attention_mla"}
