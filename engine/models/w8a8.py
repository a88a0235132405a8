"""W8A8 int8: weights quantized per output channel (symmetric, int8, one float32 scale per row), activations per
token (symmetric, int8, one float32 scale per row of the step), dynamically at each step; int8 x int8 products
accumulated in int32, then scaled: ``out[m, n] = acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n])``.

This is the arithmetic of vLLM's ``compressed-tensors`` W8A8 int8 scheme (``strategy: channel`` weights,
``dynamic: true, strategy: token`` input activations) and of MindIE's W8A8 dynamic quantization. The weights come
from a float checkpoint (``--quantization w8a8``: quantized at load, a GGUF file's dequantized tensors included) or
from a compressed-tensors checkpoint (its int8 weights and scales, read as they are).

An optional ``smooth`` (SmoothQuant's per-input-channel factor, when a checkpoint provides one) divides the
activations before they are quantized; the weight it belongs to was multiplied by it when it was quantized, so
``(x / smooth) @ (W * smooth).T == x @ W.T``.

The functions here are the reference the kernels are tested against: plain PyTorch, exact integer accumulation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

QMAX = 127  # symmetric int8: codes in [-127, 127] (vLLM's and compressed-tensors' range)


@dataclass
class Int8Weight:
    """An [out, in] weight as int8 codes with one float32 scale per output row: ``W ≈ qweight * scale[:, None]``."""

    qweight: torch.Tensor               # int8 [out, in]
    scale: torch.Tensor                 # float32 [out]
    smooth: torch.Tensor | None = None  # float32 [in]: activations are divided by it before quantization

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], in the activations' units (the smoothing undone)."""
        w = self.qweight.float() * self.scale.unsqueeze(1)
        return w if self.smooth is None else w / self.smooth

    @staticmethod
    def cat(parts: Sequence[Int8Weight], name: str) -> Int8Weight:
        """The parts of a fused projection (q/k/v, gate/up) stacked by rows, codes and scales; they read one input,
        so a smoothing factor must be one for all (ValueError naming ``name`` otherwise)."""
        smooth = parts[0].smooth
        for p in parts:
            same = (p.smooth is None and smooth is None) or (
                p.smooth is not None and smooth is not None and torch.equal(p.smooth, smooth))
            if not same:
                raise ValueError(f"{name}: the parts of a fused projection have different smoothing factors")
        return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), smooth)

    def pad_rows(self, rows: int) -> Int8Weight:
        """Zero rows appended up to ``rows`` (a vocabulary-parallel lm_head's padding): outputs of exactly 0."""
        extra = rows - self.shape[0]
        return Int8Weight(torch.cat([self.qweight, self.qweight.new_zeros(extra, self.shape[1])]),
                          torch.cat([self.scale, self.scale.new_ones(extra)]), self.smooth)

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scale.to(device),
                          None if self.smooth is None else self.smooth.to(device))


def quantize_weight(weight: torch.Tensor, smooth: torch.Tensor | None = None) -> Int8Weight:
    """Per-output-channel symmetric int8 of a float [out, in] weight (multiplied by ``smooth`` [in] first, when
    given): ``scale = max|row| / 127`` (rows of zeros get scale 1), ``q = round(w / scale)``."""
    w = weight.detach().float()
    if smooth is not None:
        w = w * smooth.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous(), None if smooth is None else smooth.float().contiguous())


def quantize_tokens(x: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 of activations [M, K] (divided by ``smooth`` first): (int8 [M, K], float32 [M]),
    ``scale = max|row| / 127`` (1 for a row of zeros), ``q = round(x / scale)`` (half away from zero is not
    required: kernels may round half to even, as ``torch.round`` does)."""
    xf = x.float()
    if smooth is not None:
        xf = xf / smooth
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(xf / scale.unsqueeze(1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def w8a8_reference(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The W8A8 product in plain PyTorch: int32 accumulation (exact, in int64 here), then
    ``acc * x_scale[m] * w_scale[n]`` in float32, plus ``bias``, cast to ``out_dtype`` (``x``'s by default)."""
    q, x_scale = quantize_tokens(x, weight.smooth)
    acc = q.to(torch.int64) @ weight.qweight.to(torch.int64).t()
    out = acc.float() * x_scale.unsqueeze(1) * weight.scale.unsqueeze(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)
