"""W8A8 int8 with static activation quantization, as msModelSlim writes it (its ``W8A8`` type) and vLLM-Ascend runs
it (``vllm_ascend/quantization/methods/w8a8_static.py``): the weight is int8 per output channel, the activations
are quantized with one scale and one offset per tensor, fixed at calibration, and the int8 x int8 products are
accumulated in int32, shifted by an int32 ``quant_bias`` and scaled back by one float ``deq_scale`` per output
channel:

    x_q[m, k]   = clamp(round(x[m, k] / input_scale + input_offset), -128, 127)
    out[m, n]   = (sum_k x_q[m, k] * qweight[n, k] + quant_bias[n]) * deq_scale[n]

msModelSlim's saver (``msmodelslim/core/quant_service/modelslim_v1/save/ascendv1.py``, ``on_w8a8_static``) computes
``deq_scale = input_scale * weight_scale`` and ``quant_bias = round(bias / deq_scale - input_offset *
sum_k qweight[n, k])``: the layer's float bias and the input offset's correction are both in ``quant_bias``, so
the layer adds no bias of its own.

The functions here are the reference the linear methods are tested against: plain PyTorch, exact integer sums.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.w8a8 import Int8Weight

INT8_MIN, INT8_MAX = -128, 127   # msModelSlim's codes use the whole signed range


@dataclass
class StaticInt8Weight:
    """An [out, in] int8 weight with its static activation quantization: ``input_scale`` and ``input_offset``
    (float32 scalars; the offset a whole number in [-128, 127]), ``deq_scale`` (float32 [out]) and ``quant_bias``
    (int32 [out])."""

    qweight: torch.Tensor       # int8 [out, in]
    input_scale: torch.Tensor   # float32 []
    input_offset: torch.Tensor  # float32 []
    deq_scale: torch.Tensor     # float32 [out]
    quant_bias: torch.Tensor    # int32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: the codes times ``deq_scale / input_scale`` (the weight scale msModelSlim divided by),
        for the dense copy the loader's shape checks read; the offset and ``quant_bias`` are not in it."""
        return self.qweight.float() * (self.deq_scale / self.input_scale).unsqueeze(1)

    @staticmethod
    def cat(parts: Sequence[StaticInt8Weight], name: str) -> StaticInt8Weight:
        """The parts of a fused projection (q/k/v, gate/up) stacked by rows. They read one input, so they must have
        one input scale and offset: ValueError naming ``name`` otherwise (vLLM-Ascend keeps one per fused layer too,
        the last part's, without checking)."""
        first = parts[0]
        for part in parts[1:]:
            if not (torch.equal(part.input_scale, first.input_scale)
                    and torch.equal(part.input_offset, first.input_offset)):
                raise ValueError(f"{name}: the parts of a fused projection have different static input scales or "
                                 f"offsets ({float(first.input_scale)}, {float(first.input_offset)} against "
                                 f"{float(part.input_scale)}, {float(part.input_offset)}); one activation "
                                 "quantization per input is supported")
        return StaticInt8Weight(torch.cat([p.qweight for p in parts]), first.input_scale, first.input_offset,
                                torch.cat([p.deq_scale for p in parts]), torch.cat([p.quant_bias for p in parts]))

    def pad_rows(self, rows: int) -> StaticInt8Weight:
        """Zero rows appended up to ``rows`` (a vocabulary-parallel lm_head's padding): outputs of exactly 0."""
        extra = rows - self.shape[0]
        return StaticInt8Weight(torch.cat([self.qweight, self.qweight.new_zeros(extra, self.shape[1])]),
                                self.input_scale, self.input_offset,
                                torch.cat([self.deq_scale, self.deq_scale.new_ones(extra)]),
                                torch.cat([self.quant_bias, self.quant_bias.new_zeros(extra)]))

    def to(self, device: torch.device) -> StaticInt8Weight:
        return StaticInt8Weight(self.qweight.to(device), self.input_scale.to(device), self.input_offset.to(device),
                                self.deq_scale.to(device), self.quant_bias.to(device))


# A projection's int8 weight: dynamic per-token activations (engine.models.w8a8) or static ones.
AnyInt8Weight = Int8Weight | StaticInt8Weight


def cat_parts(parts: Sequence[AnyInt8Weight], name: str) -> AnyInt8Weight:
    """The parts of fused projection ``name`` stacked by rows; ValueError when they mix static and dynamic
    activations (msModelSlim types W8A8 and W8A8_DYNAMIC: vLLM-Ascend refuses that mix too)."""
    static = [p for p in parts if isinstance(p, StaticInt8Weight)]
    dynamic = [p for p in parts if isinstance(p, Int8Weight)]
    if static and dynamic:
        raise ValueError(f"{name}: the parts of a fused projection mix static and dynamic W8A8 (msModelSlim W8A8 "
                         "and W8A8_DYNAMIC); all parts must have one type")
    return StaticInt8Weight.cat(static, name) if static else Int8Weight.cat(dynamic, name)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor) -> torch.Tensor:
    """int8 codes of activations ``x`` (any float dtype): ``round(x / input_scale + input_offset)`` in float32,
    half to even (``torch.round``), saturated to [-128, 127]: msModelSlim's documented formula."""
    return torch.round(x.float() / input_scale + input_offset).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


def w8a8_static_reference(x: torch.Tensor, weight: StaticInt8Weight,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The static W8A8 product in plain PyTorch: the codes' sums exact (int64 here), plus ``quant_bias``, then
    times ``deq_scale`` in float32, cast to ``out_dtype`` (``x``'s by default)."""
    q = quantize_static(x, weight.input_scale, weight.input_offset)
    acc = q.to(torch.int64) @ weight.qweight.to(torch.int64).t() + weight.quant_bias.to(torch.int64)
    return (acc.float() * weight.deq_scale).to(out_dtype or x.dtype)
