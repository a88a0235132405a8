"""TEST-ONLY TWIN of torch-npu's W8A8 operators, on the CPU: ``torch_npu.npu_dynamic_quant``,
``torch_npu.npu_quantize`` and ``torch_npu.npu_quant_matmul``; and of its weight-only ones,
``npu_convert_weight_to_int4pack`` and ``npu_weight_quant_batchmatmul``; written from torch-npu's API reference
(Ascend Extension for PyTorch, 6.0.0 / 7.0.0 / 7.2.0 pages) and, for the int64 form of a scale, CANN's
aclnnTransQuantParam page. Rounding is half to even here; the hardware's is not modelled."""
from __future__ import annotations

import numpy as np
import torch

from tests.engine.npu_twin._ops import operator
from tests.engine.npu_twin._ops import require as _require

_FLOAT_INPUTS = (torch.float16, torch.bfloat16)


@operator
def npu_dynamic_quant(x: torch.Tensor, *, smooth_scales: torch.Tensor | None = None,
                      group_index: torch.Tensor | None = None,
                      dst_type: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8 quantization: ``x`` (float16/bfloat16, rank > 1) times ``smooth_scales`` (1-D, x's
    last dimension, x's dtype) when given; per row ``scale = rowMax(|x|) / 127`` and ``y = round(x / scale)``.
    Returns (y int8, x's shape; scale float32, x's shape without its last dimension)."""
    _require(x.dtype in _FLOAT_INPUTS, f"npu_dynamic_quant: x must be float16 or bfloat16, got {x.dtype}", TypeError)
    _require(x.dim() > 1, f"npu_dynamic_quant: x must have more than one dimension, got {x.dim()}")
    _require(group_index is None, "npu_dynamic_quant twin: group_index (the MoE form) is not modelled")
    _require(dst_type in (None, torch.int8), f"npu_dynamic_quant twin: dst_type {dst_type} (int4) is not modelled")
    xf = x.float()
    if smooth_scales is not None:
        _require(smooth_scales.dim() == 1 and smooth_scales.shape[0] == x.shape[-1],
                 f"npu_dynamic_quant: smooth_scales must be 1-D of x's last dimension {x.shape[-1]}, got "
                 f"{tuple(smooth_scales.shape)}")
        _require(smooth_scales.dtype == x.dtype, f"npu_dynamic_quant: smooth_scales must have x's dtype {x.dtype}, "
                                                 f"got {smooth_scales.dtype}", TypeError)
        xf = xf * smooth_scales.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / divisor.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8)
    return y, scale


@operator
def npu_quantize(input: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, dtype: torch.dtype,
                 axis: int = 1, div_mode: bool = True) -> torch.Tensor:
    """Per-element quantization along the last axis. With ``div_mode`` False (the form vLLM-Ascend's static W8A8
    calls): ``y = round(input * scales + zero_points)`` saturated to int8, ``scales`` and ``zero_points`` 1-D of
    ``input``'s last dimension (or 1), ``zero_points`` with ``scales``' shape and dtype, ``scales`` with ``input``'s
    dtype (7.2.0's page), ``dtype`` torch.qint8; the result is int8 with ``input``'s shape. The product is formed
    in float32 here. Modelled: ``div_mode`` False, ``dtype`` torch.qint8, the last axis (any ``axis`` above -2)."""
    op = "npu_quantize"
    _require(input.dtype in (torch.float32, *_FLOAT_INPUTS),
             f"{op}: input must be float32, float16 or bfloat16, got {input.dtype}", TypeError)
    _require(isinstance(div_mode, bool), f"{op}: div_mode must be a bool, got {div_mode!r}", TypeError)
    _require(not div_mode, f"{op} twin: div_mode True (input / scales) is not modelled")
    _require(dtype == torch.qint8, f"{op} twin: dtype {dtype} is not modelled (torch.qint8; quint4x2 packs int4)",
             TypeError)
    _require(isinstance(axis, int) and -2 < axis < input.dim(),
             f"{op} twin: axis {axis!r} is not modelled (the last axis: an int above -2 within input's dimensions)")
    k = input.shape[-1]
    _require(scales.dim() == 1 and scales.shape[0] in (1, k),
             f"{op}: scales must be 1-D of input's last dimension {k} (or 1), got {tuple(scales.shape)}")
    _require(scales.dtype == input.dtype, f"{op}: scales must have input's dtype {input.dtype}, got {scales.dtype}",
             TypeError)
    if zero_points is not None:
        _require(zero_points.shape == scales.shape,
                 f"{op}: zero_points must have scales' shape {tuple(scales.shape)}, got {tuple(zero_points.shape)}")
        _require(zero_points.dtype == scales.dtype,
                 f"{op}: zero_points must have scales' dtype {scales.dtype}, got {zero_points.dtype}", TypeError)
    y = input.float() * scales.float()
    if zero_points is not None:
        y = y + zero_points.float()
    return torch.round(y).clamp_(-128, 127).to(torch.int8)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 values of ``npu_quant_matmul``'s scale. The int64 form (what npu_trans_quant_param returns, and what
    msModelSlim stores for float16 models) holds a float32's bits in its low 32 bits, of which the hardware keeps the
    high 19 (aclnnTransQuantParam: ``scale & 0xFFFFE000``, bit 46 set); an offset packed in bits 37-45 is not
    modelled."""
    if scale.dtype != torch.int64:
        return scale.float()
    _require(bool((((scale >> 32) & ~(1 << 14)) == 0).all()),
             "npu_quant_matmul twin: an int64 scale with an offset packed in (bits 37-45) is not modelled")
    bits = ((scale & 0xFFFFFFFF) & 0xFFFFE000).numpy().astype(np.uint32)
    return torch.from_numpy(bits.view(np.float32).copy())


@operator
def npu_quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset: torch.Tensor | None = None,
                     pertoken_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quantized matmul ``x1 [m, k] @ x2 [k, n]`` (int8, 2 to 6 dimensions), int32 accumulation, then
    ``* scale [n or 1] (* pertoken_scale [m])``, bias added, written as ``output_dtype`` (int8 when None).

    Modelled here, int8 inputs as the documentation's dtype table has them: with a per-token scale (dynamic W8A8):
    output bfloat16 with scale float32/bfloat16 and bias int32/bfloat16/float32, output float16 with scale float32
    and bias int32/float16/float32, no offset; without one (static W8A8): output bfloat16 with scale
    float32/bfloat16 and bias int32/bfloat16/float32, output float16 with scale int64/float32 and bias int32, output
    int8 with scale int64/float32, bias int32 and an optional float32 offset. An int32 bias joins the int32 sums
    before the scale; a float bias is added after it (aclnnQuantMatmul's formulas)."""
    for name, t in (("x1", x1), ("x2", x2)):
        _require(t.dtype == torch.int8, f"npu_quant_matmul twin: {name} must be int8 (int32-packed int4 is not "
                                        f"modelled), got {t.dtype}", TypeError)
        _require(2 <= t.dim() <= 6, f"npu_quant_matmul: {name} must have 2 to 6 dimensions, got {t.dim()}")
    k, n = x2.shape[-2], x2.shape[-1]
    _require(x1.shape[-1] == k, f"npu_quant_matmul: x1's last dimension {x1.shape[-1]} != x2's k {k} (x2 is [k, n])")
    _require(scale.dim() == 1 and scale.shape[0] in (1, n),
             f"npu_quant_matmul: scale must be 1-D of size 1 or n={n}, got {tuple(scale.shape)}")
    if offset is not None:
        _require(offset.dtype == torch.float32 and offset.dim() == 1 and offset.shape[0] in (1, n),
                 f"npu_quant_matmul: offset must be float32, 1-D of size 1 or n={n}, got {offset.dtype} "
                 f"{tuple(offset.shape)}")
    _require(output_dtype in (None, torch.int8, torch.float16, torch.bfloat16),
             f"npu_quant_matmul: output_dtype must be int8, float16 or bfloat16, got {output_dtype}", TypeError)
    m = x1.shape[-2]
    if pertoken_scale is not None:
        _require(pertoken_scale.dtype == torch.float32,
                 f"npu_quant_matmul: pertoken_scale must be float32, got {pertoken_scale.dtype}", TypeError)
        _require(pertoken_scale.dim() == 1 and pertoken_scale.shape[0] == m,
                 f"npu_quant_matmul: pertoken_scale must be 1-D of x1's m={m}, got {tuple(pertoken_scale.shape)}")
        _require(output_dtype in (torch.float16, torch.bfloat16),
                 f"npu_quant_matmul: with pertoken_scale the output is float16 or bfloat16, got {output_dtype}")
        _require(offset is None, "npu_quant_matmul: offset is not taken with pertoken_scale")
        scales = (torch.float32, torch.bfloat16) if output_dtype == torch.bfloat16 else (torch.float32,)
        biases = (torch.int32, output_dtype, torch.float32)
    elif output_dtype == torch.bfloat16:
        _require(offset is None, "npu_quant_matmul: offset is taken with int8 output only")
        scales, biases = (torch.float32, torch.bfloat16), (torch.int32, torch.bfloat16, torch.float32)
    else:
        _require(offset is None or output_dtype in (None, torch.int8),
                 "npu_quant_matmul: offset is taken with int8 output only")
        scales, biases = (torch.int64, torch.float32), (torch.int32,)
    _require(scale.dtype in scales, f"npu_quant_matmul: scale must be one of {scales} for output {output_dtype}, "
                                    f"got {scale.dtype}", TypeError)
    if bias is not None:
        _require(bias.dtype in biases, f"npu_quant_matmul: bias must be one of {biases} for output {output_dtype}, "
                                       f"got {bias.dtype}", TypeError)
        _require(bias.dim() == 1 and bias.shape[0] == n,
                 f"npu_quant_matmul twin: bias must be 1-D of n={n} (the 3-D form is not modelled), got "
                 f"{tuple(bias.shape)}")
    acc = x1.to(torch.int64) @ x2.to(torch.int64)
    if bias is not None and bias.dtype == torch.int32:   # an int32 bias joins the accumulator, before the scales
        acc = acc + bias.to(torch.int64)
    out = acc.float() * _scale_values(scale)
    if pertoken_scale is not None:
        out = out * pertoken_scale.unsqueeze(-1)
    if offset is not None:
        out = out + offset.float()
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    if output_dtype in (None, torch.int8):
        return torch.round(out).clamp_(-128, 127).to(torch.int8)
    return out.to(output_dtype)


@operator
def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """int32 weight [k, n] holding int4 values in [-8, 7] (2-D, contiguous, last dimension a multiple of 8) packed
    8 to an int32: [k, n / 8]. The device's interleaved placement is not modelled: the twin puts element ``8j + i`` of
    a row in bits ``4i`` of word ``j``, and its ``npu_weight_quant_batchmatmul`` reads that layout back."""
    op = "npu_convert_weight_to_int4pack"
    _require(weight.dtype == torch.int32, f"{op}: weight must be int32, got {weight.dtype}", TypeError)
    _require(weight.dim() == 2 and weight.shape[-1] % 8 == 0,
             f"{op}: weight must be 2-D with a last dimension a multiple of 8, got {tuple(weight.shape)}")
    _require(weight.is_contiguous(), f"{op}: weight must be contiguous")
    _require(bool(((weight >= -8) & (weight <= 7)).all()), f"{op}: values must be in int4's range [-8, 7]")
    nibbles = (weight & 0xF).to(torch.int64).reshape(weight.shape[0], -1, 8)
    words = (nibbles << (torch.arange(8) * 4)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    nibbles = (packed.unsqueeze(-1) >> (torch.arange(8, dtype=torch.int32) * 4)) & 0xF
    values = nibbles.reshape(packed.shape[0], -1)
    return torch.where(values >= 8, values - 16, values)


@operator
def npu_weight_quant_batchmatmul(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                                 antiquant_offset: torch.Tensor | None = None, quant_scale: torch.Tensor | None = None,
                                 quant_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                                 antiquant_group_size: int = 0, inner_precise: int = 0) -> torch.Tensor:
    """Weight-only quantized matmul ``x [m, k] @ W``, ``W = (weight + antiquant_offset) * antiquant_scale`` [k, n],
    plus ``bias``, in ``x``'s dtype (float16 or bfloat16). ``weight``: int8 [k, n] or int32 [k, n / 8] (int4 packed by
    ``npu_convert_weight_to_int4pack``). ``antiquant_scale``, in ``x``'s dtype: per tensor (1,), per channel (n,) or
    (1, n), or per group (ceil(k / antiquant_group_size), n) with ``antiquant_group_size`` a multiple of 32 in
    [32, k - 1]; ``antiquant_offset`` the scale's shape and dtype. Modelled: no output quantization (``quant_scale``,
    ``quant_offset`` None), float scales (not the int64 form), 2-D ``x``; the product is formed in float32."""
    op = "npu_weight_quant_batchmatmul"
    _require(x.dtype in _FLOAT_INPUTS, f"{op}: x must be float16 or bfloat16, got {x.dtype}", TypeError)
    _require(x.dim() == 2, f"{op} twin: x must be 2-D (m, k), got {x.dim()} dimensions")
    _require(weight.dim() == 2 and weight.dtype in (torch.int8, torch.int32),
             f"{op}: weight must be 2-D int8 or int32 (int4 packed), got {weight.dtype} {tuple(weight.shape)}")
    _require(quant_scale is None and quant_offset is None,
             f"{op} twin: output quantization (quant_scale, quant_offset) is not modelled")
    w = weight.float() if weight.dtype == torch.int8 else _unpack_int4(weight).float()
    k, n = w.shape
    _require(x.shape[1] == k, f"{op}: x's k {x.shape[1]} != weight's k {k} (weight is [k, n])")
    _require(antiquant_scale.dtype == x.dtype,
             f"{op}: antiquant_scale must have x's dtype {x.dtype}, got {antiquant_scale.dtype}", TypeError)
    group = antiquant_group_size
    if group:
        _require(group % 32 == 0 and 32 <= group < k,
                 f"{op}: antiquant_group_size must be a multiple of 32 in [32, k - 1], got {group} (k={k})")
        shapes: tuple[tuple[int, ...], ...] = ((-(-k // group), n),)
    else:
        shapes = ((1,), (n,), (1, n))
    _require(tuple(antiquant_scale.shape) in shapes,
             f"{op}: antiquant_scale must have shape {' or '.join(map(str, shapes))}, got "
             f"{tuple(antiquant_scale.shape)}")
    if antiquant_offset is not None:
        _require(antiquant_offset.shape == antiquant_scale.shape and antiquant_offset.dtype == antiquant_scale.dtype,
                 f"{op}: antiquant_offset must have antiquant_scale's shape and dtype", TypeError)
    if bias is not None:
        _require(bias.dtype in (x.dtype, torch.float32) and tuple(bias.shape) in ((n,), (1, n)),
                 f"{op}: bias must be ({n},) in x's dtype or float32, got {bias.dtype} {tuple(bias.shape)}")

    def per_row(t: torch.Tensor) -> torch.Tensor:   # [groups, n] or a per-channel form -> [k, n]
        t = t.float().reshape(-1, n) if t.numel() > 1 else t.float().reshape(1, 1)
        return t.repeat_interleave(group, dim=0)[:k] if group else t

    if antiquant_offset is not None:
        w = w + per_row(antiquant_offset)
    w = w * per_row(antiquant_scale)
    out = x.float() @ w
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
