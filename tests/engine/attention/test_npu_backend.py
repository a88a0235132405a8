"""NpuAttentionBackend on the torch-npu operator twin against TorchAttentionBackend, on one StepLayout: the same KV
cache writes and the same attention output (float16 tolerance) for fresh prefills, a chunk after cached context
beside a decode, and decodes alone, over 128-token blocks handed out out of order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention.backend import AttentionBackend, StepLayout
from engine.attention.npu_backend import NpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)

BLOCK = 128
HQ, HKV, D = 4, 2, 32
SCALE = D ** -0.5


class Sequences:
    """Block tables and lengths of a few sequences, blocks taken from a shuffled free list (block 0 is padding)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = [int(b) for b in np.random.default_rng(5).permutation(np.arange(1, num_blocks))]
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def layout(self, chunks: list[tuple[str, int]], num_decodes: int) -> StepLayout:
        slots: list[int] = []
        for seq, n in chunks:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            self.lens[seq] = start + n
            while len(table) * BLOCK < self.lens[seq]:
                table.append(self.free.pop())
            slots.extend(table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n))
        width = max(len(self.tables[s]) for s, _ in chunks) + 1
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for row, (seq, _) in enumerate(chunks):
            tables[row, :len(self.tables[seq])] = self.tables[seq]
        return StepLayout(slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
                          query_lens=[n for _, n in chunks], seq_lens=[self.lens[s] for s, _ in chunks],
                          num_decodes=num_decodes, block_size=BLOCK)


def _run(backend: AttentionBackend, cache: torch.Tensor, layout: StepLayout, q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor) -> torch.Tensor:
    meta = backend.build_metadata(layout, torch.device("cpu"))
    return backend.forward(q, k, v, cache, meta, SCALE)


@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_backend_matches_the_torch_backend() -> None:
    npu, ref = NpuAttentionBackend(twin), TorchAttentionBackend()
    num_blocks = 8
    gen = torch.Generator().manual_seed(0)
    # Garbage, not zeros, in both caches: a read of a slot never written shows up.
    cache = torch.randn(npu.kv_cache_shape(num_blocks, BLOCK, HKV, D), generator=gen).to(torch.float16)
    npu_cache, ref_cache = cache.clone(), cache.clone()
    seqs = Sequences(num_blocks)
    steps = [([("a", 5), ("b", 130)], 0),              # fresh prefills, one over two blocks
             ([("b", 1), ("a", 140)], 1),              # a decode beside a chunk after 5 cached tokens
             ([("a", 1), ("b", 1)], 2)]                # decodes alone
    for chunks, num_decodes in steps:
        layout = seqs.layout(chunks, num_decodes)
        tokens = sum(n for _, n in chunks)
        # Views of one fused projection, as the model hands them over (not contiguous).
        qkv = (torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen) * 2).to(torch.float16)
        q = qkv[:, :HQ * D].view(tokens, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(tokens, HKV, D)
        got = _run(npu, npu_cache, layout, q, k, v)
        expected = _run(ref, ref_cache, layout, q, k, v)
        assert torch.equal(npu_cache, ref_cache)   # the same slots written with the same values
        assert got.shape == (tokens, HQ, D) and got.dtype == torch.float16
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-2)
    assert set(twin.CALLED) == {"_npu_reshape_and_cache", "_npu_paged_attention",
                                          "npu_fused_infer_attention_score"}


@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_backend_refuses_other_block_sizes() -> None:
    with pytest.raises(ValueError, match="block_size.*blocks of 128, got 16"):
        NpuAttentionBackend(twin).kv_cache_shape(8, 16, HKV, D)


@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_backend_metadata_has_the_operators_dtypes() -> None:
    seqs = Sequences(8)
    seqs.layout([("a", 3)], 0)
    meta = NpuAttentionBackend(twin).build_metadata(seqs.layout([("a", 1), ("b", 200)], 1),
                                                              torch.device("cpu"))
    assert meta.slots.dtype == meta.decode_block_table.dtype == meta.prefill_block_table.dtype == torch.int32
    assert meta.decode_context_lens.dtype == torch.int32 and meta.decode_context_lens.tolist() == [4]
    assert meta.prefill_query_ends == [200] and meta.prefill_kv_lens == [200]
    assert meta.decode_block_table.tolist() == [seqs.tables["a"] + [0, 0]]   # padded to b's 2 blocks + 1
    assert meta.mask is not None and meta.mask.shape == (2048, 2048) and bool(meta.mask[0, 1]) and not meta.mask[1, 0]
