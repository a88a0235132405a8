"""The linear methods of W8A8 with static activation quantization (``engine.models.w8a8_static``: msModelSlim's
``W8A8`` type): on the CPU through exact int8 sums, on an Ascend NPU through ``npu_quantize`` and
``npu_quant_matmul`` as vLLM-Ascend calls them. The layer's own bias is not added: ``quant_bias`` holds it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.device.kernel_choice import KernelChoice
from engine.models.layers.linear_method import EXACT_FLOAT32_DEPTH_FULL_RANGE, LinearMethod, int8_matmul
from engine.models.w8a8_static import StaticInt8Weight, quantize_static

if TYPE_CHECKING:
    from engine.models.layers.linear import Linear


class StaticW8A8LinearMethod(LinearMethod):
    """Static W8A8 on the CPU (or any device's PyTorch ops): the rows quantized with the layer's input scale and
    offset (``quantize_static``), ``int8_matmul``'s exact sums (slices of at most
    ``EXACT_FLOAT32_DEPTH_FULL_RANGE``: both sides' codes may be -128), plus ``quant_bias`` in int32, times
    ``deq_scale`` in float32: equal to ``w8a8_static_reference`` bit for bit. Like the portable dynamic method it
    keeps the codes as float32, the operand of a float32 GEMM."""

    def __init__(self, weight: StaticInt8Weight) -> None:
        self.codes_t = weight.qweight.float().t()
        self.input_scale = weight.input_scale.float()
        self.input_offset = weight.input_offset.float()
        self.deq_scale = weight.deq_scale.float()
        self.quant_bias = weight.quant_bias.to(torch.int32)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        q = quantize_static(x, self.input_scale, self.input_offset)
        acc = int8_matmul(q, self.codes_t, EXACT_FLOAT32_DEPTH_FULL_RANGE).to(torch.int32)
        return ((acc + self.quant_bias).float() * self.deq_scale).to(x.dtype)


# The model dtypes the NPU method runs, each with the dequantization scale npu_quant_matmul takes for that output
# (its documented dtype table): bfloat16 output with a float32 scale, float16 output with the int64 form.
NPU_STATIC_DTYPES = (torch.bfloat16, torch.float16)


class NpuStaticW8A8LinearMethod(LinearMethod):
    """Static W8A8 on an Ascend NPU, as vLLM-Ascend's ``AscendW8A8LinearMethod``
    (``vllm_ascend/quantization/methods/w8a8_static.py``) calls torch-npu: per step ``npu_quantize(x, 1 /
    input_scale, input_offset, torch.qint8, -1, False)`` (both repeated over the input features, in the activations'
    dtype; ``div_mode`` False multiplies by the reciprocal: ``round(x * (1 / input_scale) + input_offset)``), then
    ``npu_quant_matmul(x_q, weight [in, out], deq_scale, bias=quant_bias, output_dtype=x.dtype)``:
    ``(x_q @ weight + quant_bias) * deq_scale``. ``deq_scale`` goes in as float32 for bfloat16 output and, for
    float16 output, as int64 holding the float32's bits (msModelSlim's form for float16 models, which vLLM-Ascend
    passes as it is; the operator takes no float32 scale there without a per-token one).

    ``quant_bias`` carries the layer's float bias; a row-parallel shard other than the first holds zeros (the
    loader's doing: vLLM-Ascend passes ``bias=None`` on those ranks), so the summed ranks add it once. The operands
    of both 16-bit dtypes are made here, once; a step reads its dtype's. No hardware has run this: the calls are
    checked against the test-only twin of the operators (tests/engine/npu_twin/quant.py)."""

    def __init__(self, npu_ops: Any, weight: StaticInt8Weight) -> None:
        self.ops = npu_ops
        in_features = weight.shape[1]
        self.weight_t = weight.qweight.t().contiguous()                # int8 [in, out]
        self.quant_bias = weight.quant_bias.to(torch.int32).contiguous()
        deq_scale = weight.deq_scale.float().contiguous()
        deq_scales = {torch.bfloat16: deq_scale, torch.float16: deq_scale.view(torch.int32).to(torch.int64)}
        self.operands: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for dtype in NPU_STATIC_DTYPES:
            scale = weight.input_scale.reshape(1).to(dtype)   # vLLM-Ascend holds input_scale in the model's dtype
            self.operands[dtype] = ((1 / scale).repeat(in_features), weight.input_offset.reshape(1).to(dtype)
                                    .repeat(in_features), deq_scales[dtype])

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in self.operands:
            raise TypeError(f"static W8A8 on the NPU runs bfloat16 or float16 models, not {x.dtype}")
        reciprocal, offset, deq_scale = self.operands[x.dtype]
        q = self.ops.npu_quantize(x, reciprocal, offset, torch.qint8, -1, False)
        return self.ops.npu_quant_matmul(q, self.weight_t, deq_scale, bias=self.quant_bias, output_dtype=x.dtype)


def static_w8a8_method(weight: StaticInt8Weight, choice: KernelChoice) -> LinearMethod:
    """The NPU's method when the device offers torch-npu's operators, else the exact PyTorch one."""
    if choice.npu_ops is not None:
        return NpuStaticW8A8LinearMethod(choice.npu_ops, weight)
    return StaticW8A8LinearMethod(weight)
