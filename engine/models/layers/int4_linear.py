"""The linear methods of weight-only 4-bit layers (``Linear.int4``: GPTQ, AWQ, compressed-tensors W4A16).

CPU: ``Int4PackLinearMethod`` runs PyTorch's own int4 CPU kernel, ``aten._weight_int4pack_mm_for_cpu`` on the
weight packed once by ``aten._convert_weight_to_int4pack_for_cpu``. What that kernel computes (checked against
float32 in tests/engine/models/test_int4_linear.py, torch 2.13): ``x @ W.T`` with
``W[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n]`` for codes ``q`` in 0..15, scales and "zeros"
(an additive offset, tinygemm's convention) in ``x``'s dtype, ``g`` in {32, 64, 128, 256}, ``N`` a multiple of 16;
bfloat16, float16 and float32 activations. A checkpoint's ``(q - z) * s`` is that with ``zero = (8 - z) * s``, a GGUF
K-quant's ``q * s + offset`` that with ``zero = 8 * s + offset``;
groups of other sizes that are multiples of an allowed one (per-channel weights) repeat their scale over the
kernel's smaller groups. Decode steps of 1-4 rows run our own ``int4_gemv`` on the same packed weight where the
compiled kernels are loaded (``GEMV_MAX_ROWS``). ``Int4DequantLinearMethod`` serves the rest (other shapes, other
devices than CPU): it dequantizes the weight at each call and runs ``F.linear``; correct, not fast.

NPU: ``NpuInt4LinearMethod`` maps a layer to torch-npu's weight-only matmul as vLLM-Ascend's W4A16 does, checked only
against the test-only operator twin (tests/engine/npu_twin/quant.py). CUDA: refused by name (no W4A16 kernel).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.device.kernel_choice import KernelChoice
from engine.models.int4 import Int4Weight
from engine.models.layers.linear_method import LinearMethod

if TYPE_CHECKING:
    from engine.models.layers.linear import Linear

KERNEL_GROUP_SIZES = (256, 128, 64, 32)   # what _weight_int4pack_mm_for_cpu takes, largest first
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIDPOINT = 8   # the kernel's codes are centred on 8
_BLOCK_N = 64   # rows per block of the kernel's packed layout (``dequantize_packed``)
_HALF = _BLOCK_N // 2
# Steps of at least this many rows dequantize the weight into the dense GEMM instead of running the int4 kernel
# (docs/benchmarks.md, "Weight-only 4-bit linears": measured crossover).
DENSE_MIN_ROWS = 64
# Steps of at most this many rows run our own GEMV (``int4_gemv``, engine/kernels/int4_ops.cpp) where the compiled
# kernels are loaded, on the same packed codes and table: float32 rows always (torch's kernel runs float32 at
# 0.1-0.3 GB/s), bfloat16 rows where the build has its AVX-512 loops (1.4-2.8x torch's kernel; the portable loops
# are not faster than it). docs/benchmarks.md, "Weight-only 4-bit linears".
GEMV_MAX_ROWS = 4
# Weights dequantized per tile of the dense path (a multiple of 64 output features): 4 MiB of bfloat16.
TILE_ELEMENTS = 1 << 21


def kernel_group_size(weight: Int4Weight) -> int | None:
    """The group size the CPU int4 kernel runs ``weight`` with (a divisor of its own in KERNEL_GROUP_SIZES), or
    None when the kernel cannot take it (output rows not a multiple of 16, groups not a multiple of 32)."""
    out, cols = weight.shape
    if out % 16 or cols % 2:
        return None
    return next((g for g in KERNEL_GROUP_SIZES if weight.group_size % g == 0 and cols % g == 0), None)


class Int4PackLinearMethod(LinearMethod):
    """PyTorch's int4 CPU kernel on a packed copy of the codes (half a byte per weight) with per-group scales and
    offsets in the model's dtype (``Int4Weight.dtype``; another dtype's table is made on first use); an act-order
    weight reads ``x[:, perm]``.

    The kernel is a per-row one (its time grows with the rows like a matrix-vector product's): from
    ``dense_min_rows`` rows on, a step dequantizes the packed weight tile by tile (``TILE_ELEMENTS`` weights at a
    time, so the transient stays a few MiB) into the activations' dtype and multiplies each tile with the dense GEMM
    (oneDNN), which is faster there (docs/benchmarks.md, "Weight-only 4-bit linears"). Both paths compute
    ``x @ ((q - 8) * scale + zero).T`` from the same packed codes and table. With ``ops`` (the compiled kernels),
    steps of up to ``GEMV_MAX_ROWS`` rows of a dtype in ``gemv_dtypes`` run ``ops.int4_gemv`` on them instead of
    torch's kernel."""

    def __init__(self, weight: Int4Weight, group_size: int, dense_min_rows: int | None = DENSE_MIN_ROWS,
                 ops: Any = None) -> None:
        self.group_size = group_size
        self.gemv = None if ops is None else ops.int4_gemv
        self.gemv_dtypes: tuple[torch.dtype, ...] = (
            () if ops is None else (torch.float32, torch.bfloat16) if ops.int4_gemv_isa() else (torch.float32,))
        self.dense_min_rows = dense_min_rows
        self.perm = weight.perm
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        repeat = weight.group_size // group_size
        scales = weight.scales.repeat_interleave(repeat, dim=1)               # [out, groups]
        additive = ((_MIDPOINT - weight.zeros) * weight.scales if weight.offsets is None
                    else _MIDPOINT * weight.scales + weight.offsets)
        offsets = additive.repeat_interleave(repeat, dim=1)
        dtype = weight.dtype if weight.dtype in KERNEL_DTYPES else torch.float32
        # [groups, out, 2] in the model's dtype: a bfloat16 model keeps no float32 copy
        self.scale_and_zero = torch.stack([scales.t(), offsets.t()], dim=-1).to(dtype).contiguous()
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {dtype: self.scale_and_zero}

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        sz = self._by_dtype.get(dtype)
        if sz is None:
            sz = self._by_dtype[dtype] = self.scale_and_zero.to(dtype)
        return sz

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the int4 CPU kernel runs bfloat16, float16 or float32 activations, not {x.dtype}")
        sz = self._table(x.dtype)
        rows = x.index_select(1, self.perm) if self.perm is not None else x.contiguous()
        bias = layer.method_bias
        if self.dense_min_rows is not None and rows.shape[0] >= self.dense_min_rows:
            return self._dense(rows, sz, bias)
        if self.gemv is not None and 0 < rows.shape[0] <= GEMV_MAX_ROWS and x.dtype in self.gemv_dtypes:
            out = self.gemv(rows, self.packed, self.group_size, sz)
            return out if bias is None else out.add_(bias)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, sz)
        return out if bias is None else out.add_(bias)

    def _dense(self, x: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` with ``W`` dequantized tile by tile (output features ``n0:n1``) into ``x``'s
        dtype, each tile's product written into its columns of the output."""
        n, k = self.out_features, self.in_features
        step = max(_BLOCK_N, TILE_ELEMENTS // k // _BLOCK_N * _BLOCK_N)
        buf = torch.empty(k * min(step, n), dtype=x.dtype)
        if step >= n:
            out = x @ dequantize_packed(self.packed, sz, n, k, 0, n, buf.view(k, n))
        else:
            out = torch.empty(x.shape[0], n, dtype=x.dtype)
            for n0 in range(0, n, step):
                n1 = min(n, n0 + step)
                tile = buf[:k * (n1 - n0)].view(k, n1 - n0)
                out[:, n0:n1] = x @ dequantize_packed(self.packed, sz, n, k, n0, n1, tile)
        return out if bias is None else out.add_(bias)


def _centred(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 as int8 ``codes - 8`` (exact, and cheaper to subtract here than in the float tile)."""
    return codes.view(torch.int8).sub_(_MIDPOINT)


def dequantize_packed(packed: torch.Tensor, sz: torch.Tensor, n: int, k: int, n0: int, n1: int,
                      out: torch.Tensor) -> torch.Tensor:
    """Writes ``W[n0:n1].T`` ([k, n1 - n0], ``out``'s dtype) from the kernel's packed weight (``packed``, from
    ``_convert_weight_to_int4pack_for_cpu``: uint8 [n, k / 2]) and its table ``sz`` ([groups, n, 2]):
    ``(q - 8) * scale + zero``; ``n0`` a multiple of 64. Returns ``out``.

    The packed layout (torch 2.13's CPU kernel, checked in tests/engine/models/test_int4_linear.py): the first
    ``n // 64 * 64`` rows in blocks of 64, each block ``k`` runs of 32 bytes, byte ``j`` of run ``c`` holding row
    ``j``'s column ``c`` in its low nibble and row ``32 + j``'s in its high one; the last ``n % 64`` rows (``t``)
    one block of ``k`` runs of ``t / 2`` bytes, byte ``j`` holding rows ``2j`` (low) and ``2j + 1`` (high)."""
    groups = sz.shape[0]
    g = k // groups
    flat = packed.view(-1)
    full = n // _BLOCK_N * _BLOCK_N
    end = min(n1, full)
    if end > n0:
        nb = (end - n0) // _BLOCK_N
        codes = flat[n0 * k // 2:end * k // 2].view(nb, groups, g, _HALF)
        o = out[:, :end - n0].view(groups, g, nb, 2, _HALF).permute(2, 0, 1, 3, 4)    # [nb, groups, g, 2, 32]
        o[..., 0, :].copy_(_centred(codes & 0xF))
        o[..., 1, :].copy_(_centred(codes >> 4))
        scale, zero = (sz[:, n0:end, i].contiguous().view(groups, nb, 2, _HALF).permute(1, 0, 2, 3).unsqueeze(2)
                       for i in (0, 1))
        torch.addcmul(zero, o, scale, out=o)
    if n1 > full:
        t = n - full
        codes = flat[full * k // 2:].view(groups, g, t // 2)
        o = out[:, full - n0:].view(groups, g, t // 2, 2)
        o[..., 0].copy_(_centred(codes & 0xF))
        o[..., 1].copy_(_centred(codes >> 4))
        scale, zero = (sz[:, full:, i].contiguous().view(groups, 1, t // 2, 2) for i in (0, 1))
        torch.addcmul(zero, o, scale, out=o)
    return out


class Int4DequantLinearMethod(LinearMethod):
    """The weight dequantized at every call (``Int4Weight.dequantize`` in the activations' dtype), then
    ``F.linear``: for shapes and devices the kernel does not take."""

    def __init__(self, weight: Int4Weight) -> None:
        self.weight = weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize().to(x.dtype), layer.method_bias)


# The activations' dtypes npu_weight_quant_batchmatmul takes (its scales and offsets must match them).
NPU_DTYPES = (torch.bfloat16, torch.float16)


class NpuInt4LinearMethod(LinearMethod):
    """Weight-only 4-bit on an Ascend NPU: ``npu_weight_quant_batchmatmul(x, weight, antiquant_scale,
    antiquant_offset, bias=..., antiquant_group_size=g)``, which computes ``x @ ((weight + offset) * scale)``. The
    weight goes in as signed int4 ``codes - 8`` [in, out] packed 8 to an int32 by ``npu_convert_weight_to_int4pack``;
    the offset per group is then ``8 - zero`` (so that ``(codes - 8 + 8 - zero) * scale`` is the checkpoint's
    weight), scales and offsets [groups, out] in the activations' dtype (made once per dtype), ``g`` 0 for one group
    per output channel. An act-order weight reads ``x[:, perm]``. ``npu_ops`` is the ``torch_npu`` module
    (``KernelChoice.npu_ops``); no hardware has run this, only the operator twin."""

    def __init__(self, npu_ops: Any, weight: Int4Weight) -> None:
        out, cols = weight.shape
        if weight.offsets is not None:
            raise ValueError("GGUF K-quant 4-bit weights (additive offsets) run on the CPU, not the NPU")
        if out % 8:
            raise ValueError(f"a 4-bit weight of {out} output features does not pack 8 to an int32 on the NPU")
        per_channel = weight.group_size == cols
        if not per_channel and (weight.group_size % 32 or weight.group_size >= cols):
            raise ValueError(f"npu_weight_quant_batchmatmul takes groups of a multiple of 32 below {cols} features, "
                             f"not {weight.group_size}")
        self.ops = npu_ops
        self.perm = weight.perm
        self.group_size = 0 if per_channel else weight.group_size
        signed = weight.codes.to(torch.int32).t().contiguous() - _MIDPOINT     # [in, out], -8..7
        self.weight = npu_ops.npu_convert_weight_to_int4pack(signed)
        scale, offset = weight.scales.t(), (_MIDPOINT - weight.zeros).t()       # [groups, out]
        self.scale = (scale[0] if per_channel else scale).contiguous()
        self.offset = (offset[0] if per_channel else offset).contiguous()
        self._by_dtype: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in NPU_DTYPES:
            raise TypeError(f"4-bit weights on the NPU run bfloat16 or float16 models, not {x.dtype}")
        pair = self._by_dtype.get(x.dtype)
        if pair is None:
            pair = self._by_dtype[x.dtype] = (self.scale.to(x.dtype), self.offset.to(x.dtype))
        rows = x.index_select(1, self.perm) if self.perm is not None else x
        bias = layer.method_bias
        return self.ops.npu_weight_quant_batchmatmul(rows, self.weight, pair[0], pair[1],
                                                     bias=None if bias is None else bias.to(x.dtype),
                                                     antiquant_group_size=self.group_size)


def int4_method(weight: Int4Weight, choice: KernelChoice) -> LinearMethod:
    """A 4-bit layer's method: the NPU's on an NPU; on the CPU its kernel where it takes the weight, else
    dequantize-per-call; ValueError on CUDA, which has no 4-bit method yet."""
    device = weight.codes.device.type
    if choice.npu_ops is not None:
        return NpuInt4LinearMethod(choice.npu_ops, weight)
    if device == "cuda":
        raise ValueError("4-bit weight-only checkpoints (GPTQ, AWQ, compressed-tensors W4A16) run on the CPU and "
                         "the NPU: no CUDA W4A16 kernel is wired")
    group = kernel_group_size(weight)
    if group is not None and device == "cpu":
        return Int4PackLinearMethod(weight, group, ops=choice.ops)
    return Int4DequantLinearMethod(weight)
