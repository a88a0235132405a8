"""What every linear method is (``LinearMethod``), and the exact int8 GEMM the portable int8 methods share
(``int8_matmul``): apart from ``linear`` so that methods in other modules (``static_w8a8_linear``) build on them
without importing the module that picks the methods."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.models.layers.linear import Linear


class LinearMethod(ABC):
    """How one layer computes ``x @ W.T + b`` for 2-D ``x`` (``b``: the layer's ``method_bias``)."""

    # Whether it reads ``layer.weight`` (else the layer frees it, unless the weight is shared).
    reads_weight: bool = False

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


# Up to this many int8 products per sum, a float32 GEMM of the codes is exact in any summation order: every partial
# sum is an integer of magnitude <= 1040 * 127 * 127 = 16,774,160 < 2^24.
EXACT_FLOAT32_DEPTH = 1040
# The same bound for codes that may be -128 on both sides (static activations, msModelSlim's weights):
# 1024 * 128 * 128 = 2^24.
EXACT_FLOAT32_DEPTH_FULL_RANGE = 1024


def int8_matmul(q: torch.Tensor, codes_t: torch.Tensor, depth: int = EXACT_FLOAT32_DEPTH) -> torch.Tensor:
    """int8 codes [M, K] @ ``codes_t`` (the weight's codes as float32, [K, N]) with exact integer sums: float32 GEMMs
    over slices of at most ``depth`` of K (float32 out), their results summed in int32 (int32 out).
    Not ``torch._int_mm``: on CPU it runs oneDNN's int8 GEMM, whose u8 x s8 pair sums saturate in int16 without
    VNNI (tests/engine/models/layers/test_w8a8_linear.py shows it with ONEDNN_MAX_CPU_ISA=AVX512_CORE)."""
    k = q.shape[1]
    xf = q.float()
    if k <= depth:
        return xf @ codes_t
    acc = (xf[:, :depth] @ codes_t[:depth]).to(torch.int32)
    for start in range(depth, k, depth):
        end = start + depth
        acc += (xf[:, start:end] @ codes_t[start:end]).to(torch.int32)
    return acc
