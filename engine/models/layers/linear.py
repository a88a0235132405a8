"""Linear layers and the methods that compute them.

A :class:`Linear` holds one :class:`LinearMethod`, picked once at load by :func:`choose_linear_method` from its
weights (dense, GGUF blocks) and the device's :class:`KernelChoice`; ``forward`` calls it and never branches on
kernels. Methods that only pay off for small steps (the block-quantized and AMX ones) hand larger steps to the
method they wrap. LoRA is one more method of the same shape. A tensor-parallel layer holds its shard of the
weight, so every method runs (and packs) the shard; a row-parallel one (:class:`RowParallelLinear`) sums its
ranks' products and adds its bias after its method.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.device.kernel_choice import KernelChoice
from engine.distributed import ParallelContext
from engine.models.int4 import Int4Weight
from engine.models.layers.int4_linear import int4_method
from engine.models.layers.linear_method import LinearMethod, int8_matmul
from engine.models.layers.static_w8a8_linear import static_w8a8_method
from engine.models.quant import QuantWeight
from engine.models.w8a8 import Int8Weight, quantize_tokens
from engine.models.w8a8_static import AnyInt8Weight, StaticInt8Weight

# Up to this many rows, a CPU float32 matmul runs faster as ``weight @ x.T`` than as ``x @ weight.T``:
# measured with torch 2.13's MKL on 2 AVX2 cores, 576 -> 3072 took 1.09 ms instead of 1.51 ms at 32 rows and
# the 576 -> 49152 lm_head 22 ms instead of 33 ms; from about 512 rows on the two are even.
SMALL_BATCH_ROWS = 256

# Steps of up to this many rows of a bfloat16 model run amx_linear on a tile-packed copy of the weight where the
# CPU has AMX: bound by reading the weights, it streams them 1.3-1.5x faster than oneDNN's GEMM at these sizes
# (the default model's projections and lm_head: 11.8 ms against 17.5 ms per step at 32 rows; docs/cpu-kernels.md).
# Larger steps (prefill) run oneDNN. It replaces the layer's GGUF blocks: a 1-sequence decode step took
# 13.4-14.0 ms on amx_linear against 14.4-16.0 ms on the blocks.
AMX_LINEAR_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a 2-D batch, computed as ``(weight @ x.T).T`` for small CPU float32 batches."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 1 < x.shape[0] <= SMALL_BATCH_ROWS:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked (blocked) copy of a float32 or bfloat16 [out, in] CPU weight, for ``onednn_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def quant_linear(ops: Any, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)`` by the float32 kernel; float32 out for any ``x`` dtype."""
    out = ops.quant_linear(x if x.dtype == torch.float32 else x.float(), weight.codes, weight.scales, weight.mins,
                           weight.format)
    return out if bias is None else out.add_(bias)


def amx_packable(weight: torch.Tensor | None) -> bool:
    """Whether ``cpu_ops.amx_pack_linear`` takes this [out, in] weight (bfloat16, both sides multiples of 32)."""
    return (weight is not None and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0)


class DenseLinearMethod(LinearMethod):
    """The layer's own weight through ``F.linear`` (``weight @ x.T`` for small CPU float32 batches)."""

    reads_weight = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.weight, layer.method_bias)


class OneDnnLinearMethod(LinearMethod):
    """oneDNN on a prepacked copy of the weight (what vLLM's CPU backend and inductor's freezing use): from 1.1x
    (576 -> 3072 at 128 rows) to 2x (the 576 -> 49152 lm_head at 32 rows) faster than ``F.linear`` on 2 cores."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = onednn_pack(weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, layer.method_bias)


class BlockQuantLinearMethod(LinearMethod):
    """The ``quant_linear`` kernel on the checkpoint's GGUF blocks for steps of up to ``max_rows`` rows (None: all),
    ``fallback`` for larger ones. Float32 models run every step here (1.2-2.5x faster per model step than oneDNN on
    the dequantized weights, whose copies are then freed); bfloat16 models only the smallest steps."""

    def __init__(self, ops: Any, blocks: QuantWeight, max_rows: int | None, fallback: LinearMethod | None,
                 cast_output: bool = True) -> None:
        if max_rows is not None and fallback is None:
            raise ValueError("a row limit needs a fallback method for the larger steps")
        self.ops = ops
        self.blocks = blocks
        self.max_rows = max_rows
        self.fallback = fallback
        self.cast_output = cast_output  # False: float32 out (an lm_head's logits)
        self.reads_weight = fallback is not None and fallback.reads_weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is None or x.shape[0] <= self.max_rows:
            out = quant_linear(self.ops, x, self.blocks, layer.method_bias)
            return out.to(x.dtype) if self.cast_output and out.dtype != x.dtype else out
        assert self.fallback is not None
        return self.fallback.apply(layer, x)


class AmxLinearMethod(LinearMethod):
    """``amx_linear`` on a tile-packed bfloat16 copy for steps of up to ``AMX_LINEAR_MAX_ROWS`` rows, ``fallback``
    (oneDNN) for larger ones."""

    def __init__(self, ops: Any, weight: torch.Tensor, fallback: LinearMethod) -> None:
        self.ops = ops
        self.packed = ops.amx_pack_linear(weight)
        self.fallback = fallback
        self.reads_weight = fallback.reads_weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= AMX_LINEAR_MAX_ROWS and x.dtype == torch.bfloat16:
            rows = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads whole rows
            return self.ops.amx_linear(rows, self.packed, layer.method_bias)
        return self.fallback.apply(layer, x)


class W8A8LinearMethod(LinearMethod):
    """W8A8 int8 (engine.models.w8a8) in one native call, ``ops.w8a8_linear``: the step's rows quantized per token,
    oneDNN's int8 GEMM (VNNI / AMX-INT8, int32 sums) on its prepacked copy of the weight, then scaled back per token
    and per output channel, in the reference's order: equal to ``w8a8_reference``. 1.3-1.8x faster than bfloat16
    oneDNN on the default model's larger projections at 1-2048 rows (docs/cpu-kernels.md, "W8A8 int8")."""

    def __init__(self, ops: Any, weight: Int8Weight) -> None:
        self.ops = ops
        out_features, in_features = weight.shape
        # the hint is one row: the packed layout serves every row count (tested at 1 to 2048)
        self.packed = torch.ops.onednn.qlinear_prepack(weight.qweight, [1, in_features])
        self.scale = weight.scale
        self.smooth = weight.smooth
        self.ones = torch.ones(out_features)  # oneDNN's weight scales and zero points: the sums come out unscaled
        self.zeros = torch.zeros(out_features, dtype=torch.int64)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.stride(-1) == 1 else x.contiguous()
        return self.ops.w8a8_linear(rows, self.packed, self.scale, layer.method_bias, self.smooth, self.ones,
                                    self.zeros)


class PortableW8A8LinearMethod(LinearMethod):
    """W8A8 where oneDNN's int8 GEMM is not used (no VNNI, switched off, no compiled kernels, another device):
    ``int8_matmul``'s exact sums between the same per-token quantization and scaling (``ops``' kernels when there
    are some and ``x`` is float32 or bfloat16, PyTorch's ops otherwise); equal to ``w8a8_reference``. It keeps the
    codes as float32 (4 bytes a weight: twice a bfloat16 model), what a float32 GEMM needs without a copy per step."""

    def __init__(self, ops: Any | None, weight: Int8Weight) -> None:
        self.ops = ops
        self.scale = weight.scale
        self.smooth = weight.smooth
        self.codes_t = weight.qweight.float().t()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bias = layer.method_bias
        if self.ops is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            q, x_scale = self.ops.int8_quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), self.smooth, False)
            return self.ops.int8_scale_rows(int8_matmul(q, self.codes_t), x_scale, self.scale, bias, x.dtype)
        q, x_scale = quantize_tokens(x, self.smooth)
        out = int8_matmul(q, self.codes_t).float() * x_scale.unsqueeze(1) * self.scale.unsqueeze(0)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


_DENSE = DenseLinearMethod()


class Linear(nn.Linear):
    """A linear layer whose computation is its ``method``. ``quant`` holds the checkpoint's GGUF blocks until
    ``use_kernels`` hands them to a method (or drops them); ``shares_weight``: the weight belongs to another
    module too (a tied lm_head's embedding table), so no method frees it."""

    quant: QuantWeight | None = None
    int8: AnyInt8Weight | None = None  # W8A8's int8 weight (w8a8 or w8a8_static), set before ``use_kernels``
    int4: Int4Weight | None = None     # a GPTQ / AWQ / W4A16 checkpoint's 4-bit weight (engine.models.int4)
    method: LinearMethod = _DENSE
    shares_weight: bool = False
    is_lm_head: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.method.apply(self, x)
        out = self.method.apply(self, x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @property
    def method_bias(self) -> torch.Tensor | None:
        """The bias the method adds to its product."""
        return self.bias

    def use_kernels(self, choice: KernelChoice) -> None:
        """Pick this layer's method once (after its weights are loaded); frees what the method does not read."""
        self.method = choose_linear_method(self, choice)
        self.quant = None  # held by the method now, or not usable here
        self.int8 = None
        self.int4 = None
        if not self.method.reads_weight and not self.shares_weight:
            self.weight = None  # type: ignore[assignment]

    def amx_pack_bytes(self) -> int:
        """What a tile-packed copy of this layer's weight would take (0 when it cannot have one)."""
        if self.weight is None or self.int8 is not None or self.int4 is not None:
            return 0
        if self.out_features % 32 or self.in_features % 32:
            return 0
        return 2 * self.out_features * self.in_features

    @property
    def holds_blocks(self) -> bool:
        """Whether this layer keeps GGUF blocks (waiting for ``use_kernels`` or in its method)."""
        return self.quant is not None or isinstance(self.method, BlockQuantLinearMethod)


class RowParallelLinear(Linear):
    """A layer whose input features are split over the tensor-parallel ranks (o_proj, down_proj): each rank's method
    multiplies its columns, the ranks' products are summed, then the bias is added, once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    @property
    def method_bias(self) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        out = self.parallel.all_reduce(out if out.is_contiguous() else out.contiguous())
        return out if self.bias is None else out.add_(self.bias)


# The output dtypes npu_quant_matmul writes with a per-token scale (and npu_dynamic_quant reads).
NPU_W8A8_DTYPES = (torch.bfloat16, torch.float16)


class NpuW8A8LinearMethod(LinearMethod):
    """W8A8 on an Ascend NPU, mapped to torch-npu's operators as vLLM-Ascend runs dynamic W8A8
    (``quantization/w8a8_dynamic.py``): per step, ``npu_dynamic_quant`` quantizes the rows per token (int8 codes and a
    float32 scale per row), then ``npu_quant_matmul`` multiplies them by the int8 weight, stored transposed ([in, out]:
    the operator's ``x2`` is [K, N]), scales the int32 products by the per-channel weight scale (``scale``, float32)
    and the per-token one (``pertoken_scale``), adds the bias and writes the model's dtype (``output_dtype``: bfloat16
    or float16, the only dtypes either operator takes; a float32 model cannot run it). A SmoothQuant factor
    (``Int8Weight.smooth``, by which activations are divided) goes in as ``smooth_scales``, by which
    ``npu_dynamic_quant`` multiplies: its reciprocal, in the activations' dtype as the operator requires.

    ``npu_ops`` is the ``torch_npu`` module the NPU device hands over (``KernelChoice.npu_ops``). No hardware has run
    this: the calls are checked against a test-only twin of the two operators written from torch-npu's documentation
    (tests/engine/npu_twin/torch_npu.py)."""

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


def choose_linear_method(layer: Linear, choice: KernelChoice) -> LinearMethod:
    """The method of one layer, from its weights and the device's choice (see :class:`KernelChoice`)."""
    weight = layer.weight

    def base() -> LinearMethod:
        return OneDnnLinearMethod(weight) if choice.onednn and weight is not None else _DENSE

    if layer.int8 is not None:  # int8 wins over GGUF blocks and AMX: the layer was quantized for it
        return w8a8_method(layer.int8, choice)
    if layer.int4 is not None:  # the checkpoint's own 4-bit weights
        return int4_method(layer.int4, choice)
    if choice.amx_linear and choice.ops is not None and amx_packable(weight):
        return AmxLinearMethod(choice.ops, weight, base())
    if layer.quant is not None and choice.ops is not None:
        limit = choice.quant_max_rows
        return BlockQuantLinearMethod(choice.ops, layer.quant, limit, None if limit is None else base(),
                                      cast_output=not (layer.is_lm_head and layer.shares_weight))
    return base()


def w8a8_method(weight: AnyInt8Weight, choice: KernelChoice) -> LinearMethod:
    """A W8A8 layer's method: the NPU's, oneDNN's int8 GEMM, or the portable one (``KernelChoice.int8``); a static
    weight's, the NPU's or the CPU's (``static_w8a8_linear``)."""
    if isinstance(weight, StaticInt8Weight):
        return static_w8a8_method(weight, choice)
    if choice.npu_ops is not None:
        return NpuW8A8LinearMethod(choice.npu_ops, weight)
    if choice.int8 == "onednn" and choice.ops is not None and weight.qweight.device.type == "cpu":
        return W8A8LinearMethod(choice.ops, weight)
    return PortableW8A8LinearMethod(choice.ops, weight)


def linear_methods(model: nn.Module) -> Counter[str]:
    """How many linear layers of ``model`` run each method (by class name), for logs and tests."""
    return Counter(type(m.method).__name__ for m in model.modules() if isinstance(m, Linear))
