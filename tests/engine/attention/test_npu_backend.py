"""NpuAttentionBackend on the torch-npu operator twin against TorchAttentionBackend, on one StepLayout: the same KV
cache writes and the same attention output (float16 tolerance) for fresh prefills, a chunk after cached context
beside a decode, and decodes alone, over 128-token blocks handed out out of order; and the same for sliding-window
layers (a prefill longer than the window, decodes past it, mixed steps, blocks given back behind the window), which
run every row through the fused operator's band mode."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention.backend import AttentionBackend, StepLayout
from engine.attention.npu_backend import NpuAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.block_manager import RELEASED
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

    def release_outside(self, seq: str, window: int) -> None:
        """As the block manager does when every layer slides: the blocks wholly behind the next query's window
        become RELEASED table entries."""
        table = self.tables[seq]
        done = min(max(0, (self.lens[seq] - window + 1) // BLOCK), len(table))
        table[:done] = [RELEASED] * done


def _run(backend: AttentionBackend, cache: torch.Tensor, layout: StepLayout, q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    meta = backend.build_metadata(layout, torch.device("cpu"))
    return backend.forward(q, k, v, cache, meta, SCALE, window=window)


def _qkv(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of one fused projection, as the model hands them over (not contiguous)."""
    qkv = (torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen) * 2).to(torch.float16)
    return (qkv[:, :HQ * D].view(tokens, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D),
            qkv[:, (HQ + HKV) * D:].view(tokens, HKV, D))


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
        q, k, v = _qkv(tokens, gen)
        got = _run(npu, npu_cache, layout, q, k, v)
        expected = _run(ref, ref_cache, layout, q, k, v)
        assert torch.equal(npu_cache, ref_cache)   # the same slots written with the same values
        assert got.shape == (tokens, HQ, D) and got.dtype == torch.float16
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-2)
    assert set(twin.CALLED) == {"_npu_reshape_and_cache", "_npu_paged_attention",
                                          "npu_fused_infer_attention_score"}


@pytest.mark.parametrize("window", [1, 100, 4096])
@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_backend_with_a_window_matches_the_torch_backend(window: int) -> None:
    """A sliding-window layer: its last ``window`` positions, the query's own included (windowed_attention's
    semantics); 4096 is wider than every sequence here, so the band is plain causal attention."""
    npu, ref = NpuAttentionBackend(twin), TorchAttentionBackend()
    num_blocks = 12
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(npu.kv_cache_shape(num_blocks, BLOCK, HKV, D), generator=gen).to(torch.float16)
    npu_cache, ref_cache = cache.clone(), cache.clone()
    seqs = Sequences(num_blocks)
    steps = [([("a", 5), ("b", 300)], 0),              # fresh prefills, one shorter than the window, one longer
             ([("b", 1), ("a", 140), ("c", 20)], 1),   # a decode past it; a chunk after 5 cached; a fresh prompt
             ([("a", 1), ("b", 1), ("c", 1)], 3),      # decodes alone, two past the window
             ([("c", 1), ("a", 200)], 1)]              # a chunk longer than the window after 146 cached
    for chunks, num_decodes in steps:
        layout = seqs.layout(chunks, num_decodes)
        q, k, v = _qkv(sum(n for _, n in chunks), gen)
        got = _run(npu, npu_cache, layout, q, k, v, window)
        expected = _run(ref, ref_cache, layout, q, k, v, window)
        assert torch.equal(npu_cache, ref_cache)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-2)
        for seq, _ in chunks:
            seqs.release_outside(seq, window)
    released = sum(table.count(RELEASED) for table in seqs.tables.values())
    assert released == {1: 4, 100: 2, 4096: 0}[window]   # b gives one back after step 1: step 2 reads a -1 entry
    # Every row, decodes too, went through the fused operator's band: _npu_paged_attention takes no window.
    assert twin.CALLED == {"_npu_reshape_and_cache", "npu_fused_infer_attention_score"}


@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_backend_refuses_soft_capped_scores() -> None:
    backend = NpuAttentionBackend(twin)
    seqs = Sequences(4)
    layout = seqs.layout([("a", 3)], 0)
    cache = torch.zeros(backend.kv_cache_shape(4, BLOCK, HKV, D), dtype=torch.float16)
    q, k, v = _qkv(3, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="soft-capped attention scores"):
        backend.forward(q, k, v, cache, backend.build_metadata(layout, torch.device("cpu")), SCALE, softcap=50.0)


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
    assert meta.query_ends == [1, 201] and meta.kv_lens == [4, 200]   # every row, for a windowed layer
    assert meta.decode_block_table.tolist() == [seqs.tables["a"] + [0, 0]]   # padded to b's 2 blocks + 1
    assert meta.block_table.tolist() == meta.decode_block_table.tolist() + meta.prefill_block_table.tolist()
    assert meta.block_table.dtype == torch.int32
    assert meta.mask is not None and meta.mask.shape == (2048, 2048) and bool(meta.mask[0, 1]) and not meta.mask[1, 0]


@pytest.mark.usefixtures("torch_npu_twin")
def test_npu_backend_reads_a_given_back_block_as_block_0() -> None:
    seqs = Sequences(8)
    seqs.layout([("a", 300)], 0)
    seqs.release_outside("a", 100)
    layout = seqs.layout([("a", 1)], 1)
    assert layout.block_tables[0].tolist()[:2] == [RELEASED, seqs.tables["a"][1]]
    meta = NpuAttentionBackend(twin).build_metadata(layout, torch.device("cpu"))
    assert meta.block_table.tolist() == [[0] + seqs.tables["a"][1:] + [0]]
