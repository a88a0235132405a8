"""RMSNorm, alone or fused with the residual add that precedes it (vLLM's layout: the residual stream is carried
beside the hidden states, and each add is folded into the norm that follows it)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.device.kernel_choice import KernelChoice


class RMSNorm(nn.Module):
    """Computed by PyTorch ops (float32 inside, cast back before the weight, as transformers does), or by the CPU
    kernels' one-pass ``rms_norm`` / ``add_rms_norm`` once ``use_kernels`` hands it ``ops``: the same values."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops: Any = None

    def use_kernels(self, choice: KernelChoice) -> None:
        self.ops = choice.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.stride(-1) == 1:  # what the kernel takes: [rows, features]
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self._norm(x)  # q/k norms over [tokens, heads, head_dim] views of the fused projection

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual; updated in place by the kernel) and its norm."""
        if self.ops is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
