"""The Triton paged-attention backend against dense attention in float64, one sequence at a time.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``: numpy on CPU tensors), which
checks their indexing, masking and arithmetic but not their speed or their compiled form; the ``gpu`` test runs
them compiled on CUDA. Skipped when triton is not installed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from engine.attention.backend import AttentionMetadata, StepLayout
from engine.attention.torch_backend import write_kv_cache
from tests.engine.paged_factory import PagedKV
from tests.engine.triton_interpreter import triton_backend_module

ON_GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def triton_backend() -> tuple[ModuleType, Any]:
    """(the kernel module, a backend): the interpreter on CPU, which must be chosen before the kernels are defined."""
    module = triton_backend_module()
    return module.triton_paged, module.TritonAttentionBackend()


@dataclass
class Seq:
    name: str
    context: int  # tokens already in the cache
    new: int      # tokens of this step
    q: torch.Tensor  # [new, Hq, D]
    k: torch.Tensor  # [context + new, Hkv, D]
    v: torch.Tensor


def _seqs(seed: int, shapes: list[tuple[int, int]], hq: int, hkv: int, d: int) -> list[Seq]:
    gen = torch.Generator().manual_seed(seed)
    return [Seq(f"s{i}", c, n, torch.randn(n, hq, d, generator=gen), torch.randn(c + n, hkv, d, generator=gen),
                torch.randn(c + n, hkv, d, generator=gen)) for i, (c, n) in enumerate(shapes)]


def _reference(seq: Seq, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Dense causal attention in float64 over the inputs as rounded to ``dtype``."""
    group = seq.q.shape[1] // seq.k.shape[1]
    q = seq.q.to(dtype).double().transpose(0, 1)
    k = seq.k.to(dtype).double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = seq.v.to(dtype).double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    q_pos = torch.arange(seq.context, seq.context + seq.new)[:, None]
    scores = scores.masked_fill(torch.arange(seq.context + seq.new)[None, :] > q_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _run(backend: Any, seqs: list[Seq], num_decodes: int, hq: int, hkv: int, d: int, block_size: int,
         dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Writes each sequence's context into a garbage-filled paged cache (shuffled blocks, padded block tables),
    runs the step through ``backend``. Returns (its output, the cache, the metadata)."""
    num_blocks = 2 + sum(-(-(s.context + s.new) // block_size) for s in seqs)
    kv = PagedKV(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=num_blocks, block_size=block_size,
                 seed=len(seqs))
    cache = kv.kv_caches[0].to(dtype)
    with_context = [s for s in seqs if s.context]
    if with_context:
        ctx = kv.step([(s.name, [0] * s.context) for s in with_context], num_decodes=0)
        write_kv_cache(torch.cat([s.k[:s.context] for s in with_context]),
                       torch.cat([s.v[:s.context] for s in with_context]), cache, ctx.meta.slot_mapping)
    m = kv.step([(s.name, [0] * s.new) for s in seqs], num_decodes=num_decodes).meta
    layout = StepLayout(slot_mapping=m.slot_mapping, block_tables=m.block_tables.numpy(), query_lens=m.query_lens,
                        seq_lens=m.seq_lens_host, num_decodes=num_decodes, block_size=block_size)
    cache = cache.to(device)
    meta = backend.build_metadata(layout, torch.device(device))
    new_k = torch.cat([s.k[s.context:] for s in seqs]).to(device, dtype)
    new_v = torch.cat([s.v[s.context:] for s in seqs]).to(device, dtype)
    out = backend.forward(torch.cat([s.q for s in seqs]).to(device, dtype), new_k, new_v, cache, meta, d ** -0.5)
    flat = cache.view(2, -1, hkv, d)   # the step's keys and values landed in their slots
    assert torch.equal(flat[0][meta.slot_mapping], new_k) and torch.equal(flat[1][meta.slot_mapping], new_v)
    return out, cache, meta


def _check(backend: Any, seqs: list[Seq], num_decodes: int, hq: int, hkv: int, d: int, block_size: int,
           dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    out, _, _ = _run(backend, seqs, num_decodes, hq, hkv, d, block_size, dtype, device)
    want = torch.cat([_reference(s, d ** -0.5, dtype) for s in seqs])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)


def test_gqa_decodes_straddling_blocks(triton_backend: tuple[ModuleType, Any]) -> None:
    # group 4; lengths across block boundaries; block tables padded with block 0, which holds garbage
    seqs = _seqs(0, [(0, 1), (3, 1), (4, 1), (22, 1), (39, 1)], 8, 2, 32)
    _check(triton_backend[1], seqs, 5, 8, 2, 32, block_size=4)


def test_mixed_step_decodes_fresh_prompt_and_chunk_after_context(triton_backend: tuple[ModuleType, Any]) -> None:
    # A group of 3 (not a power of two), head_dim 36 (masked to 64 lanes), one sequence of 40 new tokens
    # (two tiles of 21 tokens x 3 heads), block size 1 and 16.
    seqs = _seqs(1, [(5, 1), (17, 1), (0, 7), (9, 40), (30, 3)], 6, 2, 36)
    _check(triton_backend[1], seqs, 2, 6, 2, 36, block_size=16)
    _check(triton_backend[1], _seqs(2, [(2, 1), (0, 5), (6, 4)], 3, 1, 16), 1, 3, 1, 16, block_size=1)


def test_half_precision_within_tolerance(triton_backend: tuple[ModuleType, Any]) -> None:
    # float16 here; bfloat16 only on a GPU (the gpu test): the interpreter keeps bfloat16 as uint16 bit patterns
    # and its tl.dot multiplies them as integers.
    for dtype in (torch.float16,) if not ON_GPU else (torch.float16, torch.bfloat16):
        _check(triton_backend[1], _seqs(3, [(12, 1), (0, 9), (20, 6)], 4, 4, 64), 1, 4, 4, 64, block_size=8,
               dtype=dtype, device="cuda" if ON_GPU else "cpu")


def test_negative_slots_are_not_written_and_empty_rows_read_nothing(triton_backend: tuple[ModuleType, Any]) -> None:
    # What a captured decode graph's padding rows rely on: slot -1 writes nothing, seq_len 0 returns zeros.
    kernels = triton_backend[0]
    cache = torch.randn(2, 4, 4, 2, 16)
    before = cache.clone()
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    kernels.write_kv_cache(key, value, cache, torch.tensor([5, -1, 14]))
    flat, old = cache.view(2, 16, 2, 16), before.view(2, 16, 2, 16)
    assert torch.equal(flat[0, 5], key[0]) and torch.equal(flat[1, 14], value[2])
    untouched = [s for s in range(16) if s not in (5, 14)]
    assert torch.equal(flat[:, untouched], old[:, untouched])
    query = torch.randn(2, 4, 16)
    out = kernels.paged_attention(query, cache, torch.tensor([[1, 2], [0, 0]]), torch.arange(3),
                                  torch.tensor([6, 0]), 1, 0.25)
    assert torch.equal(out[1], torch.zeros(4, 16)) and out[0].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_kernel_on_cuda_matches_reference_in_bfloat16(triton_backend: tuple[ModuleType, Any]) -> None:
    rng = random.Random(0)
    for seed in range(6):
        hkv = rng.choice([1, 2, 8])
        hq = hkv * rng.choice([1, 4, 7])
        d = rng.choice([64, 128])
        shapes = [(rng.randint(0, 300), 1) for _ in range(rng.randint(1, 9))]
        shapes += [(rng.choice([0, rng.randint(1, 200)]), rng.randint(2, 150)) for _ in range(rng.randint(0, 3))]
        num_decodes = sum(1 for _, n in shapes if n == 1)
        _check(triton_backend[1], _seqs(seed, shapes, hq, hkv, d), num_decodes, hq, hkv, d,
               block_size=rng.choice([16, 32]), dtype=torch.bfloat16, device="cuda")


def test_decode_metadata_marks_one_token_rows(triton_backend: tuple[ModuleType, Any]) -> None:
    from engine.attention.triton_backend import MAX_QUERY_LEN, QUERY_START, decode_metadata

    layout = StepLayout(slot_mapping=torch.tensor([3, 9, 4, 5]), block_tables=np.array([[0], [2], [1]]),
                        query_lens=[1, 1, 2], seq_lens=[4, 2, 6], num_decodes=2, block_size=4)
    meta = triton_backend[1].build_metadata(layout, torch.device("cpu"))
    assert meta.derived[QUERY_START].tolist() == [0, 1, 2, 4] and meta.derived[MAX_QUERY_LEN] == 2
    decode_metadata(meta, torch.arange(4))
    assert meta.derived[MAX_QUERY_LEN] == 1 and meta.derived[QUERY_START].tolist() == [0, 1, 2, 3]
