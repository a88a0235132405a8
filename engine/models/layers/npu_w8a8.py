"""W8A8 int8 on an Ascend NPU, mapped to torch-npu's operators as vLLM-Ascend runs dynamic W8A8
(``quantization/w8a8_dynamic.py``): per step, ``npu_dynamic_quant`` quantizes the rows per token (int8 codes and a
float32 scale per row), then ``npu_quant_matmul`` multiplies them by the int8 weight, stored transposed ([in, out]:
the operator's ``x2`` is [K, N]), and scales the int32 products by the per-channel weight scale (``scale``, float32)
and the per-token one (``pertoken_scale``), adding the bias and writing the model's dtype (``output_dtype``:
bfloat16 or float16, the only dtypes either operator takes; a float32 model cannot run it).

A SmoothQuant factor (``Int8Weight.smooth``, by which activations are divided) goes in as ``smooth_scales``, by which
``npu_dynamic_quant`` multiplies: its reciprocal, in the activations' dtype as the operator requires.

``npu_ops`` is the ``torch_npu`` module the NPU device hands over; no hardware has run this here: the calls are
checked against a test-only twin of the two operators written from torch-npu's documentation
(tests/engine/npu_twin/torch_npu.py).
"""
from __future__ import annotations

from typing import Any

import torch

from engine.models.layers.linear import Linear, LinearMethod
from engine.models.w8a8 import Int8Weight

# The output dtypes npu_quant_matmul writes with a per-token scale (and npu_dynamic_quant reads).
NPU_W8A8_DTYPES = (torch.bfloat16, torch.float16)


class NpuW8A8LinearMethod(LinearMethod):
    """``npu_dynamic_quant`` then ``npu_quant_matmul`` on the layer's int8 weight (see the module's docstring)."""

    def __init__(self, npu_ops: Any, weight: Int8Weight) -> None:
        self.ops = npu_ops
        self.weight_t = weight.qweight.t().contiguous()    # int8 [in, out]
        self.scale = weight.scale.float().contiguous()      # float32 [out]
        self.inverse_smooth = None if weight.smooth is None else (1.0 / weight.smooth.float())

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in NPU_W8A8_DTYPES:
            raise TypeError(f"W8A8 on the NPU runs bfloat16 or float16 models, not {x.dtype}")
        if self.inverse_smooth is None:
            q, pertoken_scale = self.ops.npu_dynamic_quant(x)
        else:
            q, pertoken_scale = self.ops.npu_dynamic_quant(x, smooth_scales=self.inverse_smooth.to(x.dtype))
        bias = layer.method_bias
        return self.ops.npu_quant_matmul(q, self.weight_t, self.scale, pertoken_scale=pertoken_scale,
                                         bias=None if bias is None else bias.to(x.dtype), output_dtype=x.dtype)
