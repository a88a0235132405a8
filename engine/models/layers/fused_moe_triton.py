"""The CUDA method of a :class:`~engine.models.layers.fused_moe.FusedMoE` layer: the Triton fused-MoE kernels
(``engine.kernels.triton_moe``) over the layer's stacked weights, no host read (CUDA-graph capturable).

Importing this module imports triton: it is imported only where ``KernelChoice.triton_moe`` says so, as the CUDA
device imports the Triton attention backend only once triton is known to import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels import triton_moe
from engine.models.layers.moe_method import FusedMoEMethod

if TYPE_CHECKING:
    from engine.models.layers.fused_moe import FusedMoE


class TritonMoEMethod(FusedMoEMethod):
    """Routing in PyTorch, then ``triton_moe.fused_moe``: pairs sorted into per-expert blocks, one grouped GEMM for
    gate/up and one for down (the routing weight multiplied in), float32 accumulation, ids of experts that another
    rank holds dropped."""

    def apply(self, layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(layer, router_logits)
        return triton_moe.fused_moe(x, layer.w13, layer.w2, weights, ids, layer.expert_start)
