"""The 4-bit linear methods against the dequantize-then-matmul reference (``Int4Weight.dequantize``, float32):
PyTorch's int4 CPU kernel (``Int4PackLinearMethod``: its kernel below ``DENSE_MIN_ROWS`` rows, its tiles dequantized
into the dense GEMM from there on) and the dequantize-per-call fallback, at 1 to 2048 rows, odd shapes, act-order
permutations and per-channel groups; the NPU method on the test-only torch-npu operator twin; and
``Int4Weight``'s tensor-parallel cuts."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.device.kernel_choice import KernelChoice
from engine.models.int4 import Int4Weight, from_groups, pack_int32, unpack_int32
from engine.models.layers import int4_linear
from engine.models.layers.int4_linear import (
    DENSE_MIN_ROWS,
    GEMV_MAX_ROWS,
    Int4DequantLinearMethod,
    Int4PackLinearMethod,
    NpuInt4LinearMethod,
    dequantize_packed,
    int4_method,
    kernel_group_size,
)
from engine.models.layers.linear import Linear
from engine.models.sharding import Shard
from tests.engine.npu_twin import torch_npu as twin
from tests.engine.npu_twin import torch_npu_twin  # noqa: F401  (fixture)

# Bounds of max|out - reference| / max|reference| over the shapes and row counts below. Float32: the kernel's
# float32 sums in another order and its (q - 8) * s + offset form (measured <= 1.2e-6). bfloat16: the scales and
# offsets rounded to bfloat16 and a bfloat16 output (measured <= 6.7e-3).
FLOAT32_BOUND = 5e-6
BFLOAT16_BOUND = 1.5e-2


def _weight(out: int, cols: int, group: int, act_order: bool, seed: int) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols), generator=gen, dtype=torch.uint8)
    groups = cols // group
    scales = torch.rand(out, groups, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (out, groups), generator=gen).float()
    g_idx = None
    if act_order:
        g_idx = torch.empty(cols, dtype=torch.int64)
        g_idx[torch.randperm(cols, generator=gen)] = torch.arange(cols) // group
    return from_groups(codes, scales, zeros, group, g_idx, "w")


def _reference(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    return x.float() @ weight.dequantize().t()


def _err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("out, cols, group, act_order", [
    (64, 256, 32, False), (64, 256, 128, True), (48, 192, 64, True), (32, 384, 384, False), (16, 96, 32, True),
    (80, 512, 256, False),
])
@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
@pytest.mark.parametrize("dense_min_rows", [None, DENSE_MIN_ROWS], ids=["kernel", "engine"])
def test_the_cpu_kernel_equals_the_reference(out: int, cols: int, group: int, act_order: bool, rows: int,
                                             dense_min_rows: int | None) -> None:
    # "kernel": torch's int4 kernel at every row count; "engine": the engine's method (the dense path from 64 rows).
    weight = _weight(out, cols, group, act_order, seed=rows + out)
    chosen = int4_method(weight, KernelChoice())
    assert isinstance(chosen, Int4PackLinearMethod) and chosen.dense_min_rows == DENSE_MIN_ROWS
    method = Int4PackLinearMethod(weight, chosen.group_size, dense_min_rows)
    layer = Linear(cols, out, bias=True).requires_grad_(False)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    expected = _reference(x, weight) + layer.bias.detach()
    assert _err(method.apply(layer, x), expected) < FLOAT32_BOUND
    got = method.apply(layer, x.bfloat16())
    assert got.dtype == torch.bfloat16
    assert _err(got, _reference(x.bfloat16(), weight) + layer.bias.detach()) < BFLOAT16_BOUND


@pytest.mark.parametrize("out, cols, group, act_order", [
    (64, 256, 32, False), (208, 128, 64, True), (48, 192, 64, False), (80, 512, 256, True), (16, 96, 32, False),
])
def test_steps_from_the_row_threshold_dequantize_into_the_dense_gemm(out: int, cols: int, group: int,
                                                                      act_order: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Tiles of 64 features (TILE_ELEMENTS forced small) so that several tiles and the tail block are crossed.
    monkeypatch.setattr(int4_linear, "TILE_ELEMENTS", 64 * cols)
    weight = _weight(out, cols, group, act_order, seed=out + cols)
    kernel_group = kernel_group_size(weight)
    assert kernel_group is not None
    method = Int4PackLinearMethod(weight, kernel_group)
    assert method.dense_min_rows == DENSE_MIN_ROWS
    layer = Linear(cols, out, bias=True).requires_grad_(False)
    torch.nn.init.normal_(layer.bias)
    for rows in (1, DENSE_MIN_ROWS - 1, DENSE_MIN_ROWS, 300):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        expected = _reference(x, weight) + layer.bias
        assert _err(method.apply(layer, x), expected) < FLOAT32_BOUND
        got = method.apply(layer, x.bfloat16())
        assert got.dtype == torch.bfloat16
        assert _err(got, _reference(x.bfloat16(), weight) + layer.bias) < BFLOAT16_BOUND


def test_the_dense_path_runs_from_the_threshold_and_tiles_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _weight(208, 128, 32, False, seed=5)
    layer = Linear(128, 208, bias=False)
    x = torch.randn(DENSE_MIN_ROWS, 128, generator=torch.Generator().manual_seed(0))
    whole = Int4PackLinearMethod(weight, 32, dense_min_rows=DENSE_MIN_ROWS).apply(layer, x)
    monkeypatch.setattr(int4_linear, "TILE_ELEMENTS", 64 * 128)     # one block of 64 features per tile
    tiled = Int4PackLinearMethod(weight, 32, dense_min_rows=DENSE_MIN_ROWS).apply(layer, x)
    assert torch.equal(tiled, whole)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    Int4PackLinearMethod(weight, 32).apply(layer, x)   # the kernel is not called from the threshold on
    with pytest.raises(TypeError):
        Int4PackLinearMethod(weight, 32).apply(layer, x[:DENSE_MIN_ROWS - 1])


@pytest.mark.parametrize("out, cols, group, act_order", [
    (64, 256, 32, False), (208, 128, 64, True), (48, 192, 64, True), (80, 512, 128, False), (16, 96, 32, True),
    (2064, 256, 256, False),
])
def test_our_gemv_equals_the_reference_at_decode_rows(ops: Any, out: int, cols: int, group: int, act_order: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # ops.int4_gemv (native and portable builds) at 1..GEMV_MAX_ROWS rows: full 64-column blocks and tails
    # (out % 64), act-order, bias. The method runs it for float32 rows (and bfloat16 ones where the build has its
    # vector loops) with torch's kernel made uncallable, so that only ours can answer.
    check_gemv(ops, out, cols, group, act_order, monkeypatch)


def check_gemv(ops: Any, out: int, cols: int, group: int, act_order: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _weight(out, cols, group, act_order, seed=out + cols)
    method = int4_method(weight, KernelChoice(ops=ops))
    assert isinstance(method, Int4PackLinearMethod) and method.gemv is not None
    assert method.gemv_dtypes == ((torch.float32, torch.bfloat16) if ops.int4_gemv_isa() else (torch.float32,))
    layer = Linear(cols, out, bias=True).requires_grad_(False)
    torch.nn.init.normal_(layer.bias)
    inputs = {rows: torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
              for rows in range(1, GEMV_MAX_ROWS + 1)}
    torch_bf16 = {rows: Int4PackLinearMethod(weight, method.group_size).apply(layer, x.bfloat16())
                  for rows, x in inputs.items()}
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    for rows, x in inputs.items():
        assert _err(method.apply(layer, x), _reference(x, weight) + layer.bias) < FLOAT32_BOUND
        rows_in = x.bfloat16() if method.perm is None else x.bfloat16()[:, method.perm]
        got = ops.int4_gemv(rows_in, method.packed, method.group_size, method._table(torch.bfloat16))
        assert got.dtype == torch.bfloat16
        assert _err(got, _reference(x.bfloat16(), weight)) < BFLOAT16_BOUND
        # within one bfloat16 rounding of torch's kernel on the same bfloat16 table
        with_bias = got.add_(layer.bias)
        assert torch.allclose(with_bias.float(), torch_bf16[rows].float(), rtol=2 ** -7, atol=1e-2)
        if torch.bfloat16 in method.gemv_dtypes:
            assert torch.equal(method.apply(layer, x.bfloat16()), with_bias)
    with pytest.raises(TypeError):   # past GEMV_MAX_ROWS rows it is torch's kernel again
        method.apply(layer, torch.randn(GEMV_MAX_ROWS + 1, cols))


@pytest.mark.parametrize("out, cols", [(64, 32), (16, 64), (112, 96), (2064, 64), (208, 256)])
def test_the_packed_layout_unpacks_to_the_codes(out: int, cols: int) -> None:
    # Scale 1 and offset 8 make W = q: the unpacking alone, every code, against torch's own packing of it.
    codes = torch.randint(0, 16, (out, cols), generator=torch.Generator().manual_seed(out))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    sz = torch.stack([torch.ones(1, out), torch.full((1, out), 8.0)], dim=-1)
    w_t = dequantize_packed(packed, sz, out, cols, 0, out, torch.empty(cols, out))
    assert torch.equal(w_t.t(), codes.float())
    if out > 64:   # from a later block to the end, tail included
        part = dequantize_packed(packed, sz, out, cols, 64, out, torch.empty(cols, out - 64))
        assert torch.equal(part.t(), codes[64:].float())


def test_a_bfloat16_model_keeps_its_scale_table_in_bfloat16_only() -> None:
    weight = _weight(64, 256, 32, False, seed=3)
    method = Int4PackLinearMethod(replace(weight, dtype=torch.bfloat16), 32)
    assert method.scale_and_zero.dtype == torch.bfloat16
    layer = Linear(256, 64, bias=False)
    method.apply(layer, torch.randn(2, 256).bfloat16())
    assert [t.dtype for t in method._by_dtype.values()] == [torch.bfloat16]
    assert Int4PackLinearMethod(weight, 32).scale_and_zero.dtype == torch.float32   # no dtype given: float32


@pytest.mark.parametrize("out, cols, group", [(40, 96, 32), (24, 48, 16), (8, 64, 64)])
def test_shapes_the_kernel_does_not_take_fall_back_to_dequantizing(out: int, cols: int, group: int) -> None:
    weight = _weight(out, cols, group, act_order=True, seed=out)
    method = int4_method(weight, KernelChoice())
    assert isinstance(method, Int4DequantLinearMethod)
    layer = Linear(cols, out, bias=False)
    for rows in (1, 7, 65):
        x = torch.randn(rows, cols)
        assert _err(method.apply(layer, x), _reference(x, weight)) < FLOAT32_BOUND


def test_the_kernel_computes_what_the_module_docstring_says() -> None:
    # W[n, k] = (q - 8) * scale + zero, scales and "zeros" (offsets) [K / g, N, 2] in x's dtype
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.int32)
    sz = torch.randn(2, 32, 2, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(3, 64, generator=gen)
    w = (q.float() - 8) * sz[..., 0].t().repeat_interleave(32, 1) + sz[..., 1].t().repeat_interleave(32, 1)
    assert _err(torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz), x @ w.t()) < FLOAT32_BOUND


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("out, cols, group, act_order", [(64, 256, 32, True), (48, 128, 128, False)])
@pytest.mark.usefixtures("torch_npu_twin")
def test_the_npu_method_calls_the_weight_only_matmul_as_documented(dtype: torch.dtype, out: int, cols: int,
                                                                     group: int, act_order: bool) -> None:
    weight = _weight(out, cols, group, act_order, seed=out)
    layer = Linear(cols, out, bias=True).requires_grad_(False)
    layer.int4 = weight
    layer.use_kernels(KernelChoice(npu_ops=twin))
    assert isinstance(layer.method, NpuInt4LinearMethod) and layer.weight is None
    assert layer.method.group_size == (0 if group == cols else group)   # 0: one group per output channel
    twin.CALLED.clear()
    for rows in (1, 7, 64):
        x = torch.randn(rows, cols).to(dtype)
        got = layer(x)
        assert got.dtype == dtype
        assert _err(got, _reference(x, weight) + layer.bias) < BFLOAT16_BOUND
    assert twin.CALLED == {"npu_weight_quant_batchmatmul"}
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        layer(torch.randn(2, cols))


def test_pack_and_unpack_are_inverse_along_both_dims() -> None:
    codes = torch.randint(0, 16, (16, 24), dtype=torch.uint8)
    for dim in (0, 1):
        for order in (None, (0, 2, 4, 6, 1, 3, 5, 7)):
            assert torch.equal(unpack_int32(pack_int32(codes, dim, order), dim, order), codes)
    assert int(pack_int32(torch.arange(8).reshape(1, 8), 1)[0, 0]) == 0x76543210


def test_tensor_parallel_cuts() -> None:
    weight = _weight(32, 128, 32, False, 1)
    full = weight.dequantize()
    rows = weight.take(Shard(0, 16, 16), "w")
    assert torch.equal(rows.dequantize(), full[16:])
    cols = weight.take(Shard(1, 64, 64), "w")
    assert torch.equal(cols.dequantize(), full[:, 64:])
    with pytest.raises(ValueError, match="would split its groups of 32"):
        weight.take(Shard(1, 48, 48), "w")
    channel = _weight(32, 128, 128, False, 2)
    assert torch.equal(channel.take(Shard(1, 48, 48), "w").dequantize(), channel.dequantize()[:, 48:96])
    act = _weight(32, 128, 32, True, 3)
    assert torch.equal(act.take(Shard(0, 0, 8), "w").dequantize(), act.dequantize()[:8])
    with pytest.raises(ValueError, match="act-order"):
        act.take(Shard(1, 0, 64), "w")
    with pytest.raises(ValueError, match="differ in group size or act-order"):
        Int4Weight.cat([act, weight], "qkv")
    padded = weight.pad_rows(40).dequantize()
    assert torch.equal(padded[:32], full) and not padded[32:].any()
