"""bf16_prefill_attention (AVX512-BF16 CPUs without AMX) against a float64 dense causal reference, and the CPU
backend's choice of it."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention.backend import kv_cache_shape
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.kernels import cpu_ops, portable_cpu_ops
from tests.engine.paged_factory import dense_causal_attention, nan_padded_cache


def _bf16_ops() -> Any:  # the -march=native build on an AVX512-BF16 CPU, or skip
    ops = cpu_ops()
    assert ops is not None, "the CPU kernels did not build (see the warning logged)"
    if not ops.has_bf16_attention():
        pytest.skip("needs a CPU with AVX512-BF16")
    return ops


@pytest.mark.parametrize("hkv, group, d, block_size", [(3, 3, 64, 16), (2, 4, 128, 32), (1, 8, 32, 64),
                                                       (4, 1, 96, 16), (1, 16, 64, 16), (2, 5, 64, 16)])
def test_bf16_prefill_matches_dense_causal_attention(hkv: int, group: int, d: int, block_size: int) -> None:
    # Every prefill sequence of a step in one call: fresh prompts (1, 15, 16, 17, 100, 130 tokens: several
    # 64-key flash steps and work items of 48 / group positions, full and partial) and chunks after cached
    # context (5, 33, 17, 3, 70 cached: a chunk's first position anywhere in a block and a flash step). GQA groups
    # of 1-16 (5: rows not a multiple of the padding), head_dim 32-128; every cache slot no sequence owns is NaN.
    ops = _bf16_ops()
    gen = torch.Generator().manual_seed(hkv * 1000 + group * 10 + d)
    chunks = [(0, 1), (0, 15), (0, 16), (0, 17), (5, 20), (33, 31), (0, 100), (17, 1), (3, 45), (70, 60),
              (0, 130)]  # (context, new)
    lens = [c + n for c, n in chunks]
    cache, tables = nan_padded_cache(gen, lens, 160, block_size, hkv, d)
    tokens = sum(n for _, n in chunks)
    query = (torch.randn(tokens, hkv * group, d, generator=gen) * 2).bfloat16()
    starts = torch.tensor([0] + [sum(n for _, n in chunks[:i + 1]) for i in range(len(chunks))])
    out = ops.bf16_prefill_attention(query, cache, tables, starts, torch.tensor(lens), d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape and torch.isfinite(out).all()
    for i, (context, new) in enumerate(chunks):
        dense = dense_causal_attention(query[starts[i]:starts[i + 1]], cache, tables[i], context, new, group,
                                       torch.float64)
        # bfloat16 output (relative 2^-9) of float32 sums of exact bfloat16 products
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].double(), dense, rtol=2.0 ** -7, atol=4e-3)


def test_bf16_prefill_matches_sdpa_at_the_default_models_shape() -> None:
    # SmolLM2-135M's attention (9 query heads over 3 kv heads of 64), two fresh 300-token prompts: the kernel and
    # torch's own causal SDPA on the same bfloat16 inputs, within bfloat16 rounding of each other.
    ops = _bf16_ops()
    gen = torch.Generator().manual_seed(5)
    n, length, hkv, group, d, bs = 2, 300, 3, 3, 64, 16
    per_seq = -(-length // bs)
    cache = torch.randn(kv_cache_shape(n * per_seq, bs, hkv, d), generator=gen).bfloat16()
    tables = torch.randperm(n * per_seq, generator=gen).view(n, per_seq)
    query = torch.randn(n * length, hkv * group, d, generator=gen).bfloat16()
    out = ops.bf16_prefill_attention(query, cache, tables, torch.tensor([0, length, 2 * length]),
                                     torch.tensor([length, length]), d ** -0.5)
    keys = cache[0][tables].reshape(n, -1, hkv, d)[:, :length].transpose(1, 2)
    values = cache[1][tables].reshape(n, -1, hkv, d)[:, :length].transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.float().view(n, length, hkv * group, d).transpose(1, 2), keys.float(), values.float(), is_causal=True,
        scale=d ** -0.5, enable_gqa=True).transpose(1, 2).reshape(query.shape)
    torch.testing.assert_close(out.float(), ref, rtol=2.0 ** -7, atol=4e-3)


def test_bf16_prefill_rejects_what_it_cannot_run() -> None:
    ops = _bf16_ops()
    cache = torch.zeros(kv_cache_shape(4, 16, 1, 64), dtype=torch.bfloat16)
    q = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    tables, starts, lens = torch.tensor([[0, 1]]), torch.tensor([0, 3]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="bfloat16 query and KV cache"):
        ops.bf16_prefill_attention(q.float(), cache, tables, starts, lens, 0.125)
    with pytest.raises(RuntimeError, match="bad query_start or seq_len"):
        ops.bf16_prefill_attention(q, cache, tables, starts, torch.tensor([2]), 0.125)  # fewer keys than queries
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.bf16_prefill_attention(q, cache, torch.tensor([[7, 1]]), starts, lens, 0.125)
    with pytest.raises(RuntimeError, match="starts must run"):
        ops.bf16_prefill_attention(q, cache, tables, torch.tensor([0, 2]), lens, 0.125)
    with pytest.raises(RuntimeError, match="block_size % 16"):
        ops.bf16_prefill_attention(q, torch.zeros(kv_cache_shape(8, 8, 1, 64), dtype=torch.bfloat16), tables,
                                   starts, lens, 0.125)


def test_cpu_backend_picks_the_bf16_prefill_kernel_without_amx() -> None:
    # On an AVX512-BF16 CPU without AMX the backend's prefill kernel is this one; KernelSettings.amx_prefill
    # off (SLUICE_AMX_PREFILL=0) leaves prefills to SDPA.
    ops = _bf16_ops()
    if ops.has_amx_attention():
        pytest.skip("an AMX CPU takes the AMX prefill kernel")
    assert CpuAttentionBackend(ops).prefill_kernel is ops.bf16_prefill_attention
    assert CpuAttentionBackend(ops, prefill_kernel=False).prefill_kernel is None


def test_portable_build_has_no_bf16_prefill_kernel() -> None:
    # Built without AVX512-BF16 (-march=x86-64): it says so, refuses to run, and the backend keeps SDPA.
    ops = portable_cpu_ops()
    assert not ops.has_bf16_attention() and not ops.has_amx_attention()
    assert CpuAttentionBackend(ops).prefill_kernel is None
    with pytest.raises(RuntimeError, match="built without AVX512-BF16"):
        ops.bf16_prefill_attention(torch.zeros(3, 2, 64, dtype=torch.bfloat16),
                                   torch.zeros(kv_cache_shape(4, 16, 1, 64), dtype=torch.bfloat16),
                                   torch.tensor([[0, 1]]), torch.tensor([0, 3]), torch.tensor([3]), 0.125)
