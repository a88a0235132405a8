"""SiLU-and-mul over a fused gate/up projection: PyTorch ops, or the CPU kernels' one pass over memory."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.device.kernel_choice import KernelChoice


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` of ``x = [gate | up]`` (the last dimension split in halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Any = None

    def use_kernels(self, choice: KernelChoice) -> None:
        self.ops = choice.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_and_mul(x)
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up
