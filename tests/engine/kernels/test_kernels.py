"""engine/kernels/cpu_ops.cpp's elementwise kernels against the PyTorch ops they replace.

(The paged decode attention kernel is checked in test_attention.py; the whole set, through the model,
against transformers in test_models.py.)
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import _rotate


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows, width", [(1, 64), (7, 576), (33, 100), (300, 36)])
def test_rms_norm_matches_the_model_norm(ops: Any, rows: int, width: int) -> None:
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=_gen(1)))
    x = torch.randn(rows, width, generator=_gen(rows)) * 3
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-5, atol=1e-5)
    # rows may be strided (a slice of a wider tensor)
    wide = torch.randn(rows, width + 8, generator=_gen(2))
    torch.testing.assert_close(ops.rms_norm(wide[:, :width], norm.weight, 1e-5), norm(wide[:, :width]),
                               rtol=1e-5, atol=1e-5)


def test_add_rms_norm_updates_the_residual_in_place(ops: Any) -> None:
    x = torch.randn(19, 96, generator=_gen(3))
    residual = torch.randn(19, 96, generator=_gen(4))
    weight = torch.randn(96, generator=_gen(5))
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-6)
    out = ops.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul(ops: Any, rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 40, generator=_gen(rows)) * 4
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_at_extreme_gates(ops: Any) -> None:
    # exp is clamped to [-87, 88] inside: silu must still be ~0 for very negative gates and ~gate for
    # very positive ones, never inf or nan.
    gate = torch.tensor([[-1e4, -200.0, -88.5, -87.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 87.0, 88.5, 200.0, 1e4]])
    up = torch.linspace(-2, 2, gate.shape[1]).unsqueeze(0)
    out = ops.silu_and_mul(torch.cat([gate, up], dim=1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_rotary_in_place_on_a_slice_of_the_fused_projection(ops: Any) -> None:
    tokens, hq, hkv, d = 11, 4, 2, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=_gen(6))
    positions = torch.randint(0, 50, (tokens,), generator=_gen(7))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos(), freqs.sin()
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected_q, expected_k = _rotate(q, c, s), _rotate(k, c, s)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    ops.rotary_(q, positions, cos, sin)
    ops.rotary_(k, positions, cos, sin)
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, expected_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # values untouched


def test_bad_inputs_raise_instead_of_crashing(ops: Any) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.zeros(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(RuntimeError, match="shapes differ"):
        ops.add_rms_norm(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="odd width"):
        ops.silu_and_mul(torch.zeros(2, 5))
    cos = torch.zeros(8, 2)
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rotary_(torch.zeros(1, 1, 4), torch.tensor([8]), cos, cos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 7), (4, 31), (5, 32), (6, 33), (9, 100), (128, 49152)])
def test_argmax_rows_matches_torch(ops: Any, rows: int, width: int, dtype: torch.dtype) -> None:
    x = (torch.randn(rows, width, generator=_gen(width)) * 5).to(dtype)
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    # rows may be strided (logits trimmed to the vocabulary)
    wide = torch.randn(rows, width + 5, generator=_gen(width + 1)).to(dtype)
    assert torch.equal(ops.argmax_rows(wide[:, :width]), wide[:, :width].argmax(dim=-1))


def test_argmax_rows_of_bfloat16_compares_the_widened_values(ops: Any) -> None:
    # bfloat16 has 8 bits of mantissa: many equal values in a row, the first must win, in the vector loop
    # (index 40 of 64) as in the scalar tail; and values one bfloat16 step apart must not compare equal.
    x = torch.zeros(3, 67, dtype=torch.bfloat16)
    x[0, [40, 8, 60]] = 1.0
    x[0, 9] = torch.tensor(1.0).bfloat16().nextafter(torch.tensor(2.0).bfloat16())  # 1.0078125, the largest
    x[1, [66, 65]] = -0.5
    x[1, :65] = -1.0
    x[2, [66, 5, 10]] = torch.tensor([255.0, 256.0, 257.0]).bfloat16()  # 257 rounds to 256 in bfloat16: a tie, 5 wins
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [9, 65, 5]
    assert torch.equal(ops.argmax_rows(x), expected)


def test_argmax_rows_rejects_other_dtypes_and_strided_columns(ops: Any) -> None:
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.argmax_rows(torch.zeros(2, 16)[:, ::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_ties_nan_and_infinities_as_torch(ops: Any, dtype: torch.dtype) -> None:
    width = 200
    x = torch.zeros(8, width, dtype=dtype)
    x[0, [5, 77, 150]] = 3.0                         # a tie: the first index wins, in any vector lane
    x[1, [40, 8]] = 2.0                              # lanes 0 of different vectors
    x[2, [199, 197]] = 1.0                           # in the scalar tail
    x[3] = float("-inf")                             # every value -inf: index 0
    x[4, 120] = float("inf")
    x[4, 130] = float("nan")                         # NaN counts as the maximum
    x[5, [60, 9]] = float("nan")                     # the first NaN
    x[6, 0] = float("nan")                           # at index 0
    x[7, [33, 34]] = float("inf")
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [5, 8, 197, 0, 130, 9, 0, 33]
    assert torch.equal(ops.argmax_rows(x), expected)


def test_sampler_greedy_rows_use_the_device_argmax() -> None:
    from engine.core.sampling_params import SamplingParams
    from engine.device import CpuDevice
    from engine.worker.sampler import Sampler, SamplingRow

    calls: list[tuple[int, ...]] = []
    kernel = CpuDevice().row_argmax()
    assert kernel is not None

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return kernel(x)

    logits = torch.randn(3, 50, generator=_gen(9))
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, [1, 2], [], None) for _ in range(3)]
    out = Sampler(40, {2}, argmax=counted)(logits, rows)   # the vocabulary trims the 10 padding columns
    assert out.token_ids == logits[:, :40].argmax(dim=-1).tolist() and calls == [(3, 40)]
    # a bfloat16 lm_head's logits go to the kernel as they are, with no float32 copy
    calls.clear()
    out = Sampler(40, {2}, argmax=counted)(logits.bfloat16(), rows)
    assert out.token_ids == logits.bfloat16()[:, :40].argmax(dim=-1).tolist() and calls == [(3, 40)]


# bfloat16 rows (the model dtype --dtype auto picks on AVX512-BF16 / AMX CPUs): computed in float32 from the
# widened inputs and rounded to nearest-even once on the way out, so each result is the float32 result of
# the same (bfloat16) inputs, rounded: within one bfloat16 step of it (a float32 result a few ulps off
# torch's can round to the other neighbour). A step is 2^-7 of the value at most (8 significant bits).
BF16_STEP = 2.0 ** -7


def _close_to_rounded(out: torch.Tensor, exact: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, rtol=BF16_STEP, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_bfloat16(ops: Any, weight_dtype: torch.dtype) -> None:
    x = (torch.randn(33, 576, generator=_gen(20)) * 3).bfloat16()
    weight = torch.randn(576, generator=_gen(21)).to(weight_dtype)
    exact = F.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    _close_to_rounded(ops.rms_norm(x, weight, 1e-5), exact)
    wide = (torch.randn(5, 600, generator=_gen(22))).bfloat16()  # strided rows
    _close_to_rounded(ops.rms_norm(wide[:, :576], weight, 1e-5), F.rms_norm(wide[:, :576].float(), (576,),
                                                                             weight.float(), 1e-5))


def test_add_rms_norm_bfloat16_rounds_the_residual_then_normalises_it(ops: Any) -> None:
    x = torch.randn(19, 96, generator=_gen(23)).bfloat16()
    residual = torch.randn(19, 96, generator=_gen(24)).bfloat16()
    weight = torch.randn(96, generator=_gen(25)).bfloat16()
    expected_residual = residual + x  # torch's bfloat16 add: float32 sum rounded to nearest-even
    out = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    _close_to_rounded(out, F.rms_norm(expected_residual.float(), (96,), weight.float(), 1e-6))


@pytest.mark.parametrize("inter", [1536, 23, 7])
def test_silu_and_mul_bfloat16(ops: Any, inter: int) -> None:
    # 16 lanes at a time straight from bfloat16 where the CPU has AVX512-BF16, the rest of a row (23: 16 + 7)
    # through float32 rows; rows strided (a slice of a wider tensor); gates out to +-100 (exp clamped).
    wide = (torch.randn(9, 2 * inter + 5, generator=_gen(26)) * 4).bfloat16()
    wide[0, :inter] = torch.linspace(-100, 100, inter)
    gate_up = wide[:, :2 * inter]
    gate, up = gate_up.float().split(inter, dim=-1)
    _close_to_rounded(ops.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float32])
def test_rotary_bfloat16_in_place_on_a_slice_of_the_fused_projection(ops: Any, table_dtype: torch.dtype) -> None:
    tokens, hq, hkv, d = 11, 4, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=_gen(27)).bfloat16()
    positions = torch.randint(0, 50, (tokens,), generator=_gen(28))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos().to(table_dtype), freqs.sin().to(table_dtype)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    c, s = cos.float()[positions].unsqueeze(1), sin.float()[positions].unsqueeze(1)
    expected_q = _rotate(q.float(), c, s)
    v_before = qkv[:, hq * d:].clone()
    ops.rotary_(q, positions, cos, sin)
    _close_to_rounded(q, expected_q)
    assert torch.equal(qkv[:, hq * d:], v_before)  # keys and values untouched


def test_bfloat16_bad_inputs_raise(ops: Any) -> None:
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, torch.ones(4, dtype=torch.float16), 1e-5)  # neither float32 nor x's dtype
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.add_rms_norm(x, torch.zeros(2, 4), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="cos/sin"):
        ops.rotary_(torch.zeros(1, 1, 4), torch.tensor([0]), torch.zeros(8, 2).bfloat16(), torch.zeros(8, 2).bfloat16())
