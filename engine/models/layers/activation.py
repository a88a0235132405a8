"""SiLU-and-mul over a fused gate/up projection: PyTorch ops, the CPU kernels' one pass over memory, or torch-npu's
``npu_swiglu`` (the same function: silu of the first half times the second)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.device.kernel_choice import KernelChoice


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeluAndMul(nn.Module):
    """GeGLU: ``gelu_tanh(gate) * up`` of ``x = [gate | up]`` (Gemma's ``gelu_pytorch_tanh``), in PyTorch ops on
    every device (no fused kernel)."""

    def use_kernels(self, choice: KernelChoice) -> None:
        pass   # PyTorch's ops everywhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``x = [gate | up]`` (the last dimension split in halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fn: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul

    def use_kernels(self, choice: KernelChoice) -> None:
        if choice.npu_ops is not None:
            self.fn = choice.npu_ops.npu_swiglu
        else:
            self.fn = silu_and_mul if choice.ops is None else choice.ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
