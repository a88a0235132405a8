"""int8_ops.cpp: per-token int8 quantization, the scaling epilogue and the whole W8A8 linear on oneDNN's int8 GEMM,
against engine.models.w8a8's plain-PyTorch reference (int64 sums), bit for bit."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.models.w8a8 import Int8Weight, quantize_tokens, quantize_weight, w8a8_reference

DTYPES = (torch.float32, torch.bfloat16)


def _case(m: int, k: int, n: int, dtype: torch.dtype, smooth: bool = False, seed: int = 0,
          ) -> tuple[torch.Tensor, Int8Weight]:
    g = torch.Generator().manual_seed(seed)
    factor = torch.rand(k, generator=g) + 0.5 if smooth else None
    weight = quantize_weight(torch.randn(n, k, generator=g), factor)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0] = 0  # a row of zeros: scale 1, codes 0
    if m > 2:
        x[2, ::3] = 1e-3  # small values next to zeros
        x[m - 1] = x[m - 1].abs()  # a row of one sign: codes 0..127
    return x, weight


def _linear(ops: Any, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if not ops.int8_isa():   # without them oneDNN's u8 x s8 pair sums saturate (the device then runs the portable path)
        pytest.skip("oneDNN's int8 GEMM is exact only on a CPU with AVX512-VNNI, AVX-VNNI or AMX-INT8")
    n, k = weight.shape
    packed = torch.ops.onednn.qlinear_prepack(weight.qweight, [1, k])
    return ops.w8a8_linear(x, packed, weight.scale, bias, weight.smooth, torch.ones(n),
                           torch.zeros(n, dtype=torch.int64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smooth", [False, True])
def test_quantize_rows_gives_the_references_codes_and_scales(ops: Any, dtype: torch.dtype, smooth: bool) -> None:
    x, weight = _case(37, 203, 8, dtype, smooth)  # K not a multiple of 16: the masked tail
    codes, scales = quantize_tokens(x, weight.smooth)
    signed, s_scales = ops.int8_quantize_rows(x, weight.smooth, False)
    unsigned, u_scales = ops.int8_quantize_rows(x, weight.smooth, True)
    assert signed.dtype == torch.int8 and unsigned.dtype == torch.uint8
    assert torch.equal(signed, codes) and torch.equal(s_scales, scales) and torch.equal(u_scales, scales)
    assert torch.equal(unsigned.int() - 128, codes.int())
    assert scales[0].item() == 1.0 and not codes[0].any()


def test_quantize_rows_rounds_half_to_even(ops: Any) -> None:
    # max 127 -> scale 1.0: codes are round(x) exactly, and 0.5, 1.5, 2.5, -2.5 are ties
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49, -126.5]])
    codes, _ = ops.int8_quantize_rows(x, None, False)
    assert codes.tolist() == [[127, 0, 2, 2, -2, 0, 3, -126]]
    assert torch.equal(codes, quantize_tokens(x)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (7, 1537, 577), (33, 100, 65), (2048, 96, 40), (3, 17, 5)])
def test_w8a8_linear_equals_the_reference(ops: Any, dtype: torch.dtype, m: int, k: int, n: int) -> None:
    x, weight = _case(m, k, n, dtype, smooth=m % 2 == 1, seed=m)
    bias = torch.randn(n)
    for b in (None, bias, bias.to(dtype)):
        out = _linear(ops, x, weight, b)
        assert out.dtype == dtype and out.shape == (m, n)
        assert torch.equal(out, w8a8_reference(x, weight, b))


def test_w8a8_linear_sums_past_float32s_exact_integers(ops: Any) -> None:
    """Sums of codes near 127 x 127 over K = 3001 reach 4.8e7 > 2^24: the float32 oneDNN hands back must be the
    int32 sum rounded once, as the reference's int64 -> float32."""
    k = 3001
    weight = Int8Weight(torch.full((16, k), 127, dtype=torch.int8), torch.rand(16) + 0.1)
    weight.qweight[3] = -127
    weight.qweight[5, ::2] = 126
    x = torch.full((4, k), 127.0)
    x[1, ::7] = -126.0
    out = _linear(ops, x, weight, None)
    assert out.abs().max() > 2**24 * 0.1
    assert torch.equal(out, w8a8_reference(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_rows_takes_int32_sums(ops: Any, dtype: torch.dtype) -> None:
    x, weight = _case(9, 64, 24, dtype)
    codes, scales = quantize_tokens(x)
    acc = torch._int_mm(codes, weight.qweight.t())
    bias = torch.randn(24)
    out = ops.int8_scale_rows(acc, scales, weight.scale, bias, dtype)
    assert torch.equal(out, w8a8_reference(x, weight, bias))


def test_bad_inputs_name_what_is_wrong(ops: Any) -> None:
    x, weight = _case(2, 32, 8, torch.float32)
    with pytest.raises(RuntimeError, match="smooth: float32, contiguous, 32 values"):
        ops.int8_quantize_rows(x, torch.ones(31), True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.int8_quantize_rows(x.half(), None, True)
    with pytest.raises(RuntimeError, match="bias: float32, contiguous, 8 values"):
        ops.int8_scale_rows(torch.zeros(2, 8), torch.ones(2), torch.ones(8), torch.ones(7), torch.float32)


def test_int8_isa_names_this_cpus_instructions(ops: Any) -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    expected = ("amx-int8" if "amx_int8" in flags else "avx512-vnni" if "avx512_vnni" in flags
                else "avx-vnni" if "avx_vnni" in flags else "")
    assert ops.int8_isa() == expected
