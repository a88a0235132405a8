"""TorchAttentionBackend, with and without the CPU decode kernel, against naive dense causal attention,
one sequence at a time."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine.attention.backend import kv_cache_shape
from engine.attention.torch_backend import ROWS_MAX_QUERY, TorchAttentionBackend, write_kv_cache
from engine.kernels import cpu_ops, portable_cpu_ops
from tests.engine.paged_factory import PagedKV, dense_causal_attention, nan_padded_cache


@pytest.fixture(params=["torch", "kernel", "portable-kernel"])
def backend(request: pytest.FixtureRequest) -> TorchAttentionBackend:
    if request.param == "torch":
        return TorchAttentionBackend()
    if request.param == "portable-kernel":  # the loops CPUs without AVX2 run
        ops = portable_cpu_ops()
        return TorchAttentionBackend(decode_kernel=ops.paged_decode_attention, kv_writer=ops.write_kv_cache)
    kernel, writer = _kernel('paged_decode_attention'), _kernel('write_kv_cache')
    assert kernel is not None and writer is not None, "the CPU kernels did not build (see the warning logged)"
    return TorchAttentionBackend(decode_kernel=kernel, kv_writer=writer)


@dataclass
class Seq:
    name: str
    context: int  # tokens already in the KV cache
    new: int  # tokens in this step
    q: torch.Tensor  # [new, Hq, D]
    k: torch.Tensor  # [context + new, Hkv, D]
    v: torch.Tensor


def _kernel(name: str) -> Any:
    """A kernel of the native ``cpu_ops`` build, or None where it did not build."""
    ops = cpu_ops()
    return None if ops is None else getattr(ops, name)


def _prefill_kernel() -> Any:
    """The AMX prefill kernel where this CPU runs it (what ``CpuAttentionBackend`` takes), else None."""
    ops = cpu_ops()
    return ops.paged_prefill_attention if ops is not None and ops.has_amx_attention() else None


def _reference(seq: Seq, scale: float) -> torch.Tensor:
    """Dense attention in float64: query i sits at position context + i and sees keys 0..context + i."""
    group = seq.q.shape[1] // seq.k.shape[1]
    k = seq.k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    v = seq.v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    q = seq.q.double().transpose(0, 1)  # [Hq, Q, D]
    scores = q @ k.transpose(1, 2) * scale
    q_pos = torch.arange(seq.context, seq.context + seq.new)[:, None]
    scores = scores.masked_fill(torch.arange(seq.context + seq.new)[None, :] > q_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()


def _make_seqs(rng: random.Random, num_decodes: int, prefills: list[tuple[int, int]], hq: int, hkv: int,
               d: int) -> list[Seq]:
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    shapes = [(rng.randint(1, 30), 1) for _ in range(num_decodes)] + prefills
    seqs = []
    for i, (context, new) in enumerate(shapes):
        seqs.append(Seq(f"s{i}", context, new, torch.randn(new, hq, d, generator=gen),
                        torch.randn(context + new, hkv, d, generator=gen),
                        torch.randn(context + new, hkv, d, generator=gen)))
    return seqs


def _check(backend: TorchAttentionBackend, seqs: list[Seq], num_decodes: int, hq: int, hkv: int, d: int,
           block_size: int, kv_dtype: torch.dtype = torch.float32) -> None:
    kv = PagedKV(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=96, block_size=block_size,
                 seed=len(seqs), dtype=kv_dtype)
    cache = kv.kv_caches[0]
    with_context = [s for s in seqs if s.context]
    if with_context:  # put the earlier context into the cache through its own slot mapping
        ctx = kv.step([(s.name, [0] * s.context) for s in with_context], num_decodes=0)
        write_kv_cache(torch.cat([s.k[:s.context] for s in with_context]),
                       torch.cat([s.v[:s.context] for s in with_context]), cache, ctx.meta.slot_mapping)
    step = kv.step([(s.name, [0] * s.new) for s in seqs], num_decodes=num_decodes)
    assert step.meta.num_decodes == num_decodes
    new_k = torch.cat([s.k[s.context:] for s in seqs])
    new_v = torch.cat([s.v[s.context:] for s in seqs])
    scale = d ** -0.5
    out = backend.forward(torch.cat([s.q for s in seqs]), new_k, new_v, cache, step.meta, scale)
    assert out.shape == (sum(s.new for s in seqs), hq, d)
    # the step's keys and values landed in their slots
    flat = cache.view(2, -1, hkv, d)
    assert torch.equal(flat[0][step.meta.slot_mapping].float(), new_k)
    assert torch.equal(flat[1][step.meta.slot_mapping].float(), new_v)
    torch.testing.assert_close(out, torch.cat([_reference(s, scale) for s in seqs]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(24))
def test_random_mixed_batches_match_dense_reference(backend: TorchAttentionBackend, seed: int) -> None:
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 2, 4])
    # 36: the kernel's tail past its 8-float lanes; 64 and 128: its register-blocked value pass (on AVX-512
    # CPUs, groups of up to 4 query heads at 64 and up to 2 at 128 take the AVX-512 group loops).
    d = rng.choice([8, 16, 32, 36, 64, 128])
    # 8 and 16: runs of 8 tokens inside a block take the kernel's 8-keys-at-once score path.
    block_size = rng.choice([1, 4, 8, 16])
    num_decodes = rng.randint(0, 4)
    prefills = [(rng.choice([0, 0, rng.randint(1, 20)]), rng.randint(1, 9)) for _ in range(rng.randint(0, 3))]
    if num_decodes == 0 and not prefills:
        num_decodes = 1
    _check(backend, _make_seqs(rng, num_decodes, prefills, hq, hkv, d), num_decodes, hq, hkv, d, block_size)


@pytest.mark.parametrize("d, block_size", [(16, 4), (64, 16), (128, 8)])
def test_decodes_of_different_lengths(backend: TorchAttentionBackend, d: int, block_size: int) -> None:
    # lengths straddle block boundaries; the shortest sees padding and foreign blocks that must be masked
    seqs = _make_seqs(random.Random(1), 0, [(1, 1), (4, 1), (5, 1), (23, 1), (40, 1)], 6, 2, d)
    _check(backend, seqs, 5, 6, 2, d, block_size=block_size)


@pytest.mark.parametrize("d", [36, 64])
@pytest.mark.parametrize("num_decodes, threads", [(3, 2), (12, 1), (12, 2), (13, 3)])
def test_many_decodes_split_by_sequence_or_by_head(backend: TorchAttentionBackend, d: int, num_decodes: int,
                                                   threads: int) -> None:
    # The kernel gives each thread whole sequences once there are >= 4 per thread, else (sequence, kv head)
    # pairs, which threads take from a shared counter; both ways must agree with the reference, across block
    # boundaries and in GQA groups of 3.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(num_decodes * 10 + threads)
        seqs = _make_seqs(rng, 0, [(rng.randint(1, 40), 1) for _ in range(num_decodes)], 9, 3, d)
        _check(backend, seqs, num_decodes, 9, 3, d, block_size=16)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("d", [36, 64])
@pytest.mark.parametrize("num_decodes", [3, 12])
def test_reduced_precision_kv_cache(backend: TorchAttentionBackend, d: int, num_decodes: int,
                                    kv_dtype: torch.dtype) -> None:
    # --kv-cache-dtype float16: the kernel converts keys and values as it loads them; bfloat16 (and float16
    # without the kernel) go through the PyTorch paths, which cast what they gather. Keys and values here are
    # values of that dtype already, so the float64 reference is exact.
    rng = random.Random(d + num_decodes)
    seqs = _make_seqs(rng, 0, [(rng.randint(1, 40), 1) for _ in range(num_decodes)] + [(0, 5), (17, 4)], 9, 3, d)
    for s in seqs:
        s.k, s.v = s.k.to(kv_dtype).float(), s.v.to(kv_dtype).float()
    _check(backend, seqs, num_decodes, 9, 3, d, block_size=16, kv_dtype=kv_dtype)


def test_float16_cache_prefill_is_the_same_in_one_chunk_or_two(backend: TorchAttentionBackend) -> None:
    # A fresh chunk attends over its keys and values as the float16 cache holds them, so a prompt's last
    # tokens come out the same whether its start was prefilled in the same chunk or read back from the cache.
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(9, 9, 64, generator=gen)
    k, v = torch.randn(9, 3, 64, generator=gen), torch.randn(9, 3, 64, generator=gen)
    one = PagedKV(num_layers=1, num_kv_heads=3, head_dim=64, num_blocks=8, block_size=4, seed=1, dtype=torch.float16)
    whole = backend.forward(q, k, v, one.kv_caches[0], one.step([("s", [0] * 9)], num_decodes=0).meta, 0.125)
    two = PagedKV(num_layers=1, num_kv_heads=3, head_dim=64, num_blocks=8, block_size=4, seed=1, dtype=torch.float16)
    backend.forward(q[:5], k[:5], v[:5], two.kv_caches[0], two.step([("s", [0] * 5)], num_decodes=0).meta, 0.125)
    rest = backend.forward(q[5:], k[5:], v[5:], two.kv_caches[0], two.step([("s", [0] * 4)], num_decodes=0).meta, 0.125)
    torch.testing.assert_close(rest, whole[5:], rtol=1e-5, atol=1e-5)


def test_prefill_chunk_after_context_and_fresh_prefill(backend: TorchAttentionBackend) -> None:
    seqs = _make_seqs(random.Random(2), 0, [(0, 7), (9, 6), (3, 1)], 6, 3, 8)
    _check(backend, seqs, 0, 6, 3, 8, block_size=4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_fresh_prompts_of_one_length_batched_with_others_around(backend: TorchAttentionBackend,
                                                                kv_dtype: torch.dtype) -> None:
    # A wave of equal prompts goes through one batched SDPA call: three fresh 6-token prompts, then one of 6
    # tokens after 9 cached (not fresh: its own call), two fresh ones of 6 again, one of 5, and decodes first.
    prefills = [(0, 6), (0, 6), (0, 6), (9, 6), (0, 6), (0, 6), (0, 5)]
    seqs = _make_seqs(random.Random(11), 2, prefills, 6, 3, 8)
    if kv_dtype == torch.float16:  # what the cache holds is what attention sees
        for s in seqs:
            s.k, s.v = s.k.half().float(), s.v.half().float()
    calls: list[int] = []
    fresh = backend._fresh_prefills
    backend._fresh_prefills = lambda q, *a: calls.append(a[-2]) or fresh(q, *a)  # type: ignore[method-assign]
    _check(backend, seqs, 2, 6, 3, 8, block_size=4, kv_dtype=kv_dtype)
    assert calls == [3, 2]


def test_kv_cache_shape() -> None:
    assert kv_cache_shape(10, 16, 3, 64) == (2, 10, 16, 3, 64)
    cache = torch.zeros(kv_cache_shape(3, 2, 1, 1))
    write_kv_cache(torch.tensor([[[1.0]], [[2.0]]]), torch.tensor([[[3.0]], [[4.0]]]), cache, torch.tensor([5, 0]))
    # slot 5 = block 2, offset 1; slot 0 = block 0, offset 0
    assert cache[0, 2, 1, 0, 0] == 1.0 and cache[1, 2, 1, 0, 0] == 3.0
    assert cache[0, 0, 0, 0, 0] == 2.0 and cache[1, 0, 0, 0, 0] == 4.0
    assert cache.count_nonzero() == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_writer_copies_rows_like_write_kv_cache(dtype: torch.dtype) -> None:
    # The CPU kv_writer against write_kv_cache (index_copy_): keys and values as the model hands them over,
    # strided slices of one fused projection, into slots of different blocks; nothing else in the cache moves.
    writer = _kernel('write_kv_cache')
    assert writer is not None
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(7, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    key = fused[:, 9 * 64:12 * 64].view(7, 3, 64)
    value = fused[:, 12 * 64:].view(7, 3, 64)
    slots = torch.tensor([0, 5, 16, 17, 63, 40, 33])
    expected = torch.randn(kv_cache_shape(4, 16, 3, 64), generator=gen).to(dtype)
    cache = expected.clone()
    write_kv_cache(key, value, expected, slots)
    writer(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_kv_writer_rejects_what_it_cannot_copy() -> None:
    writer = _kernel('write_kv_cache')
    assert writer is not None
    cache = torch.zeros(kv_cache_shape(2, 4, 1, 8))
    kv = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        writer(kv, kv, cache, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="out of range"):
        writer(kv, kv, cache, torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="dtype"):
        writer(kv.double(), kv.double(), cache, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="one slot per token"):
        writer(kv, kv, cache, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="contiguous"):
        writer(torch.ones(2, 8, 1).transpose(1, 2), kv, cache, torch.tensor([0, 1]))
    assert cache.count_nonzero() == 0  # nothing written by a rejected call
    writer(kv, kv * 2, cache, torch.tensor([7, 0]))
    assert cache[0, 1, 3].eq(1).all() and cache[1, 0, 0].eq(2).all() and cache.count_nonzero() == 32


def test_backend_falls_back_to_index_copy_for_another_cache_dtype() -> None:
    # A float16 cache under a float32 model: the writer cannot convert, write_kv_cache does (the writer is
    # never called).
    calls: list[int] = []
    backend = TorchAttentionBackend(kv_writer=lambda *a: calls.append(1))
    rng = random.Random(9)
    seqs = _make_seqs(rng, 0, [(0, 5)], 4, 2, 16)
    for s in seqs:
        s.k, s.v = s.k.half().float(), s.v.half().float()
    _check(backend, seqs, 0, 4, 2, 16, block_size=4, kv_dtype=torch.float16)
    assert calls == []


def test_decode_kernel_rejects_bad_tables_with_an_error() -> None:
    kernel = _kernel('paged_decode_attention')
    assert kernel is not None
    cache = torch.zeros(kv_cache_shape(4, 2, 1, 8))
    query = torch.zeros(1, 2, 8)
    ok = kernel(query, cache, torch.tensor([[3, 1]]), torch.tensor([4]), 1.0)
    assert ok.shape == (1, 2, 8)
    with pytest.raises(RuntimeError, match="block id"):
        kernel(query, cache, torch.tensor([[4, 0]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="seq_len"):
        kernel(query, cache, torch.tensor([[0, 1]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(query.double(), cache.double(), torch.tensor([[0, 1]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="float16 KV cache"):
        kernel(query, cache.double(), torch.tensor([[3, 1]]), torch.tensor([4]), 1.0)


@pytest.mark.parametrize("build", ["native", "portable"])
def test_decode_kernel_reads_a_float16_cache_as_its_float32_copy(build: str) -> None:
    kernel = _kernel('paged_decode_attention') if build == "native" else portable_cpu_ops().paged_decode_attention
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(kv_cache_shape(24, 16, 3, 64), generator=gen).half()
    query = torch.randn(5, 9, 64, generator=gen)
    tables = torch.randperm(24, generator=gen)[:20].view(5, 4)
    lens = torch.tensor([1, 17, 40, 63, 64])
    expected = kernel(query, cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(kernel(query, cache, tables, lens, 0.125), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("build", ["native", "portable"])
def test_decode_kernel_takes_a_bfloat16_query_and_cache(build: str) -> None:
    # A bfloat16 model's decode: bfloat16 query and cache, widened as they are read; the result is the
    # float32 result on the widened copies, rounded once.
    kernel = _kernel('paged_decode_attention') if build == "native" else portable_cpu_ops().paged_decode_attention
    assert kernel is not None
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(kv_cache_shape(24, 16, 3, 64), generator=gen).bfloat16()
    query = torch.randn(5, 9, 64, generator=gen).bfloat16()
    tables = torch.randperm(24, generator=gen)[:20].view(5, 4)
    lens = torch.tensor([1, 17, 40, 63, 64])
    exact = kernel(query.float(), cache.float(), tables, lens, 0.125)
    out = kernel(query, cache, tables, lens, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, rtol=2.0 ** -7, atol=1e-6)
    # and the float32 kernel on the widened copies is the dense reference
    for n, length in enumerate(lens.tolist()):
        keys = cache[0][tables[n]].reshape(-1, 3, 64)[:length].float().repeat_interleave(3, dim=1)
        values = cache[1][tables[n]].reshape(-1, 3, 64)[:length].float().repeat_interleave(3, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[n].float(), keys) * 0.125
        torch.testing.assert_close(exact[n], torch.einsum("hl,lhd->hd", scores.softmax(-1), values),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("hq, hkv, d", [(3, 3, 64), (6, 3, 64), (9, 3, 64), (8, 2, 64), (2, 2, 128), (4, 2, 128),
                                        (8, 2, 128)])
def test_decode_kernel_group_shapes_and_long_blocks(backend: TorchAttentionBackend, hq: int, hkv: int, d: int,
                                                    kv_dtype: torch.dtype) -> None:
    # GQA groups of 1-4 with head_dim 64 and 1-2 with 128 run the AVX-512 group loops where the CPU has
    # AVX-512 (16 keys' scores at once, masked for a block's last keys); (8, 2, 128) is a group of 4 at 128,
    # which stays on the AVX2 loops. Blocks of 32 tokens: two rounds of 16 keys per block.
    rng = random.Random(hq * 100 + d)
    seqs = _make_seqs(rng, 0, [(n, 1) for n in (1, 15, 16, 17, 31, 33, 64, 70)], hq, hkv, d)
    for s in seqs:
        s.k, s.v = s.k.to(kv_dtype).float(), s.v.to(kv_dtype).float()
    _check(backend, seqs, len(seqs), hq, hkv, d, block_size=32, kv_dtype=kv_dtype)


def _native_ops():  # the -march=native build, or skip
    ops = cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning logged)"
    if not ops.has_amx_attention():
        pytest.skip("needs a CPU with AMX-BF16 (and Linux granting the tile state)")
    return ops


@pytest.mark.parametrize("lens", [[1, 17, 70], [1, 15, 16, 17, 31, 33, 64, 70, 100]], ids=["per-head", "per-seq"])
@pytest.mark.parametrize("hkv, group, d, block_size", [(3, 3, 64, 16), (5, 3, 64, 16), (4, 2, 128, 16),
                                                       (9, 1, 64, 32), (2, 4, 128, 32), (1, 8, 64, 16),
                                                       (2, 9, 64, 16), (4, 1, 32, 64), (1, 16, 96, 16)])
def test_amx_decode_matches_the_vector_loops(hkv: int, group: int, d: int, block_size: int, lens: list[int]) -> None:
    # bfloat16 query and cache on an AMX CPU: scores of 16 keys per tile product, keys loaded straight from the
    # cache rows, in whole 16-row tiles. The same attention as the AVX-512 / AVX2 loops (the same bfloat16
    # inputs, float32 sums in another order), and the rows a tile loads past a sequence's end never count:
    # every cache slot no sequence reads is NaN. Three sequences give one work item per kv head, nine one per
    # sequence (up to 18 query heads: two 16-lane softmax columns). Values: whole rows of 3 kv heads at once
    # (SmolLM2's shape), 3 + 2 of 5, 2 + 2 of 4 at head_dim 128, 8 + 1 of 9; the other shapes per kv head.
    ops = _native_ops()
    gen = torch.Generator().manual_seed(hkv * 1000 + group * 10 + d)
    cache, tables = nan_padded_cache(gen, lens, 64, block_size, hkv, d)
    query = torch.randn(len(lens), hkv * group, d, generator=gen).bfloat16()
    seq_lens = torch.tensor(lens)
    assert ops.set_amx_attention(False) is True  # on by default
    try:
        expected = ops.paged_decode_attention(query, cache, tables, seq_lens, d ** -0.5)
    finally:
        ops.set_amx_attention(True)
    out = ops.paged_decode_attention(query, cache, tables, seq_lens, d ** -0.5)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0 ** -7, atol=1e-3)
    # and both are the dense attention over each sequence's own keys and values
    for n, length in enumerate(lens):
        keys = cache[0][tables[n]].reshape(-1, hkv, d)[:length].float().repeat_interleave(group, dim=1)
        values = cache[1][tables[n]].reshape(-1, hkv, d)[:length].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[n].float(), keys) * d ** -0.5
        dense = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[n].float(), dense, rtol=2.0 ** -7, atol=2e-3)


@pytest.mark.parametrize("hkv, group, d, block_size", [(3, 3, 64, 16), (2, 4, 128, 32), (1, 8, 32, 64),
                                                       (4, 1, 96, 16), (1, 16, 64, 16)])
def test_amx_prefill_matches_dense_causal_attention(hkv: int, group: int, d: int, block_size: int) -> None:
    # bfloat16 query and cache on an AMX CPU: every prefill sequence of a step in one call over the paged cache,
    # fresh prompts and chunks after cached context alike. Query tiles of 16 positions, full and partial (1, 15,
    # 16, 17, 31, 100 new tokens), contexts that put a tile's first position anywhere in a 16-key tile (5, 33,
    # 17); every cache slot no sequence owns is NaN (tiles load whole 16-row tiles past a sequence's end).
    ops = _native_ops()
    gen = torch.Generator().manual_seed(hkv * 1000 + group * 10 + d)
    chunks = [(0, 1), (0, 15), (0, 16), (0, 17), (5, 20), (33, 31), (0, 100), (17, 1), (3, 45)]  # (context, new)
    lens = [c + n for c, n in chunks]
    cache, tables = nan_padded_cache(gen, lens, 128, block_size, hkv, d)
    tokens = sum(n for _, n in chunks)
    query = (torch.randn(tokens, hkv * group, d, generator=gen) * 2).bfloat16()
    starts = torch.tensor([0] + [sum(n for _, n in chunks[:i + 1]) for i in range(len(chunks))])
    out = ops.paged_prefill_attention(query, cache, tables, starts, torch.tensor(lens), d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape and torch.isfinite(out).all()
    for i, (context, new) in enumerate(chunks):
        dense = dense_causal_attention(query[starts[i]:starts[i + 1]], cache, tables[i], context, new, group,
                                       torch.float32)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].float(), dense, rtol=2.0 ** -6, atol=1e-2)


def test_amx_prefill_rejects_what_it_cannot_run() -> None:
    ops = _native_ops()
    cache = torch.zeros(kv_cache_shape(4, 16, 1, 64), dtype=torch.bfloat16)
    q = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    tables, starts, lens = torch.tensor([[0, 1]]), torch.tensor([0, 3]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="bfloat16 query and KV cache"):
        ops.paged_prefill_attention(q.float(), cache, tables, starts, lens, 0.125)
    with pytest.raises(RuntimeError, match="bad query_start or seq_len"):
        ops.paged_prefill_attention(q, cache, tables, starts, torch.tensor([2]), 0.125)  # fewer keys than queries
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_prefill_attention(q, cache, torch.tensor([[7, 1]]), starts, lens, 0.125)
    with pytest.raises(RuntimeError, match="starts must run"):
        ops.paged_prefill_attention(q, cache, tables, torch.tensor([0, 2]), lens, 0.125)
    with pytest.raises(RuntimeError, match="block_size % 16"):
        ops.paged_prefill_attention(q, torch.zeros(kv_cache_shape(8, 8, 1, 64), dtype=torch.bfloat16), tables,
                                    starts, lens, 0.125)


def test_backend_takes_a_steps_prefills_to_the_amx_kernel_in_one_call() -> None:
    # bfloat16 query and cache, 16-token blocks: every prefill of the step (a fresh 300-token prompt, 20 tokens
    # after 260 cached, a fresh 17) goes to the kernel in one call, the decodes beside it to the decode kernel.
    # 8-token blocks (not whole 16-row tiles) stay on SDPA. Both equal dense attention.
    _native_ops()
    kernel = _prefill_kernel()
    assert kernel is not None
    calls: list[list[int]] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[3].tolist())  # query_start
        return kernel(*args)

    backend = TorchAttentionBackend(decode_kernel=_kernel('paged_decode_attention'),
                                    kv_writer=_kernel('write_kv_cache'), prefill_kernel=counted)
    hq, hkv, d, rng = 9, 3, 64, random.Random(11)
    prefills = [(0, 300), (260, 20), (0, 17)]
    for block_size, taken in ((16, True), (8, False)):
        calls.clear()
        seqs = _make_seqs(rng, 2, prefills, hq, hkv, d)
        for s in seqs:
            s.q, s.k, s.v = s.q.bfloat16(), s.k.bfloat16(), s.v.bfloat16()
        kv = PagedKV(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=192 // (block_size // 8),
                     block_size=block_size, seed=3, dtype=torch.bfloat16)
        cache = kv.kv_caches[0]
        with_context = [s for s in seqs if s.context]
        ctx = kv.step([(s.name, [0] * s.context) for s in with_context], num_decodes=0)
        write_kv_cache(torch.cat([s.k[:s.context] for s in with_context]),
                       torch.cat([s.v[:s.context] for s in with_context]), cache, ctx.meta.slot_mapping)
        step = kv.step([(s.name, [0] * s.new) for s in seqs], num_decodes=2)
        out = backend.forward(torch.cat([s.q for s in seqs]), torch.cat([s.k[s.context:] for s in seqs]),
                              torch.cat([s.v[s.context:] for s in seqs]), cache, step.meta, d ** -0.5)
        assert out.dtype == torch.bfloat16 and out.shape == (sum(s.new for s in seqs), hq, d)
        assert calls == ([[0, 300, 320, 337]] if taken else [])
        torch.testing.assert_close(out.float(), torch.cat([_reference(s, d ** -0.5) for s in seqs]),
                                   rtol=2.0 ** -6, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_chunks_after_cached_context_run_as_decode_rows_in_one_call(dtype: torch.dtype) -> None:
    # The shared-prefix shape in small: chunks after cached context (two side by side, then a fresh prompt, then
    # another), decodes first. Each run of context chunks is one decode-kernel call with a row per new token.
    kernel = _kernel("paged_decode_attention")
    assert kernel is not None, "the CPU kernels did not build (see the warning logged)"
    calls: list[int] = []

    def counting(q: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(q.shape[0])
        return kernel(q, *args)

    backend = TorchAttentionBackend(decode_kernel=counting)
    seqs = _make_seqs(random.Random(7), 2, [(20, 7), (33, 5), (0, 6), (17, 9)], 6, 3, 64)
    if dtype == torch.bfloat16:   # the inputs as bfloat16 holds them; the reference stays float64
        for s in seqs:
            s.q, s.k, s.v = s.q.bfloat16().float(), s.k.bfloat16().float(), s.v.bfloat16().float()
    if dtype == torch.float32:
        _check(backend, seqs, 2, 6, 3, 64, block_size=16)
    else:
        kv = PagedKV(num_layers=1, num_kv_heads=3, head_dim=64, num_blocks=96, block_size=16, seed=3,
                     dtype=torch.bfloat16)
        cache = kv.kv_caches[0]
        ctx = [s for s in seqs if s.context]
        write_kv_cache(torch.cat([s.k[:s.context] for s in ctx]), torch.cat([s.v[:s.context] for s in ctx]), cache,
                       kv.step([(s.name, [0] * s.context) for s in ctx], num_decodes=0).meta.slot_mapping)
        meta = kv.step([(s.name, [0] * s.new) for s in seqs], num_decodes=2).meta
        new_k = torch.cat([s.k[s.context:] for s in seqs]).bfloat16()
        new_v = torch.cat([s.v[s.context:] for s in seqs]).bfloat16()
        out = backend.forward(torch.cat([s.q for s in seqs]).bfloat16(), new_k, new_v, cache, meta, 0.125)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), torch.cat([_reference(s, 0.125) for s in seqs]), atol=2e-2, rtol=2e-2)
    assert calls == [2, 7 + 5, 9]   # the decodes, the two context chunks together, the last one


def test_long_chunks_after_context_keep_the_sdpa_path() -> None:
    # Past ROWS_MAX_QUERY new tokens a chunk after context goes through gather + SDPA; the short one beside it
    # still runs as decode rows.
    kernel = _kernel("paged_decode_attention")
    assert kernel is not None, "the CPU kernels did not build (see the warning logged)"
    calls: list[int] = []
    backend = TorchAttentionBackend(decode_kernel=lambda q, *a: calls.append(q.shape[0]) or kernel(q, *a))
    seqs = _make_seqs(random.Random(8), 0, [(5, ROWS_MAX_QUERY + 1), (9, 4)], 2, 1, 16)
    _check(backend, seqs, 0, 2, 1, 16, block_size=16)
    assert calls == [4]


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (8, 2, 64), (4, 2, 128), (2, 2, 24)])
def test_decode_kernel_reads_only_a_sliding_window(build: str, kv_dtype: torch.dtype, hq: int, hkv: int,
                                                   d: int) -> None:
    """first_positions: each sequence attends over keys first .. len - 1 only (a window starting mid-block, at a
    block's start, and covering the whole context), and blocks wholly before the window are never read — their
    table entries may be given back (-1)."""
    kernel = _kernel('paged_decode_attention') if build == "native" else portable_cpu_ops().paged_decode_attention
    assert kernel is not None
    gen = torch.Generator().manual_seed(5)
    bs = 16
    cache = torch.randn(kv_cache_shape(40, bs, hkv, d), generator=gen).to(kv_dtype)
    lens = torch.tensor([70, 64, 33, 5, 100])
    firsts = torch.tensor([45, 32, 0, 0, 99])   # mid-block, a block's start, whole context, whole, the last key
    tables = torch.randperm(40, generator=gen)[:35].view(5, 7).clone()
    tables[0, :2] = -1   # given back: before the window's block
    tables[1, :2] = -1
    tables[4, :6] = -1
    query = torch.randn(5, hq, d, generator=gen).to(kv_dtype)
    out = kernel(query, cache, tables, lens, 0.2, firsts).float()
    for n, (length, first) in enumerate(zip(lens.tolist(), firsts.tolist(), strict=True)):
        rows = torch.cat([cache[:, b] if b >= 0 else torch.full_like(cache[:, 0], float("nan"))
                          for b in tables[n].tolist()], dim=1)[:, first:length].float()
        keys, values = (rows[i].repeat_interleave(hq // hkv, dim=1) for i in (0, 1))
        scores = torch.einsum("hd,lhd->hl", query[n].float(), keys) * 0.2
        expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
        tol = 2.0 ** -7 if kv_dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[n], expected, rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="first position"):
        kernel(query, cache, tables, lens, 0.2, torch.tensor([45, 32, 0, 5, 100]))   # not before the length
    with pytest.raises(RuntimeError, match="block id"):   # a given-back block inside the window
        kernel(query, cache, tables, lens, 0.2, torch.tensor([31, 32, 0, 0, 99]))


def test_windowed_decodes_run_on_the_kernel_and_match_the_explicit_path() -> None:
    """A step whose decodes are past the window: the decode rows go to the kernel with their first positions
    (one call), the prefill rows to the explicit path; together they equal the explicit path alone."""
    kernel = _kernel('paged_decode_attention')
    calls: list[torch.Tensor | None] = []

    def counting(*args: Any) -> torch.Tensor:
        calls.append(args[5] if len(args) > 5 else None)
        return kernel(*args)

    from engine.attention.torch_backend import windowed_attention

    torch.manual_seed(6)
    kv = PagedKV(1, 2, 32, block_size=8, dtype=torch.float32, backend=TorchAttentionBackend(decode_kernel=counting))
    hq = 4
    kv.step([("a", list(range(40))), ("b", list(range(25)))])   # cache the context (values do not matter)
    step = kv.step([("a", [1]), ("b", [2]), ("c", list(range(30)))])
    query = torch.randn(32, hq, 32)
    key, value = torch.randn(32, 2, 32), torch.randn(32, 2, 32)
    cache = kv.kv_caches[0]
    backend = TorchAttentionBackend(decode_kernel=counting)
    calls.clear()
    got = backend.forward(query, key, value, cache, step.meta, 0.3, window=12)
    assert len(calls) == 1 and calls[0] is not None and calls[0].tolist() == [41 - 12, 26 - 12]
    torch.testing.assert_close(got, windowed_attention(query, cache, step.meta, 0.3, 12), rtol=1e-5, atol=1e-5)
