"""What a device decides once, at load, for every layer's kernel: the one object layers read to pick theirs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

# How W8A8 int8 layers multiply: "onednn" = ``ops.w8a8_linear`` (rows quantized per token by our kernel, oneDNN's
# int8 GEMM on VNNI or AMX-INT8, our scaling epilogue); "portable" = float32 GEMMs of the int8 codes (exact: see
# ``linear.int8_matmul``) between the same quantization and epilogue (PyTorch ops without ``ops``): any CPU, same
# results.
Int8Path = Literal["onednn", "portable"]

# In a bfloat16 model, steps of up to this many rows read a layer's GGUF blocks (where amx_linear does not run):
# reading a third of the bytes wins at 1-2 rows (the default model's 120 projections: 7.3 ms on the blocks against
# 10.9 ms on oneDNN at 1 row, 9.5 against 10.8 at 2, even at 3, 16.2 against 11.0 at 8; docs/cpu-kernels.md).
# Float32 models run every step on the blocks (no limit).
BF16_QUANT_MAX_ROWS = 2


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a device offers a model's layers.

    ``ops``: the compiled CPU kernels (``engine.kernels.cpu_ops``): fused RMSNorm with the residual add,
    SiLU-and-mul, in-place rotary, and the block-quantized and AMX linears; None = PyTorch ops.
    ``onednn``: linears keep oneDNN's prepacked copy of their weight instead of the weight.
    ``quant_max_rows``: steps of at most this many rows run a layer's GGUF blocks (``ops`` needed); None = every
    step (the dense weight is then freed).
    ``amx_linear``: bfloat16 linears whose sides are multiples of 32 run steps of up to ``AMX_LINEAR_MAX_ROWS``
    rows on a tile-packed copy of their weight (replacing their blocks).
    ``int8``: how W8A8 layers (``Linear.int8``) multiply (see ``Int8Path``).
    ``npu_ops``: the ``torch_npu`` module on an NPU device (W8A8 layers then run ``npu_quant_matmul``).
    ``triton_moe``: mixture-of-experts layers run the Triton fused-MoE kernels (``engine.kernels.triton_moe``,
    through ``fused_moe_triton.TritonMoEMethod``) instead of PyTorch's per-expert products."""

    ops: Any = None
    onednn: bool = False
    quant_max_rows: int | None = None
    amx_linear: bool = False
    int8: Int8Path = "portable"
    npu_ops: Any = None
    triton_moe: bool = False

    @classmethod
    def torch(cls) -> KernelChoice:
        """PyTorch ops only (any device, any dtype)."""
        return cls()


def default_quant_max_rows(dtype: torch.dtype, override: int | None) -> int | None:
    """The row limit of block-quantized steps for a ``dtype`` model: ``override`` when set, else none for float32
    and ``BF16_QUANT_MAX_ROWS`` otherwise."""
    if override is not None:
        return override
    return None if dtype == torch.float32 else BF16_QUANT_MAX_ROWS
