"""RMSNorm, alone or fused with the residual add that precedes it (vLLM's layout: the residual stream is carried
beside the hidden states, and each add is folded into the norm that follows it)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.device.kernel_choice import KernelChoice


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32 and cast back before the weight, as transformers does."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class TorchNorm:
    """PyTorch ops: any shape."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual


class KernelNorm(TorchNorm):
    """The CPU kernels' one-pass ``rms_norm`` / ``add_rms_norm`` (the residual updated in place), on
    [rows, features] hidden states."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(x, residual, weight, eps), residual


class NpuNorm(TorchNorm):
    """torch-npu's ``npu_rms_norm`` and ``npu_add_rms_norm`` (the add fused into the norm), as vLLM-Ascend's RMSNorm
    calls them."""

    def __init__(self, npu_ops: Any) -> None:
        self.ops = npu_ops

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.npu_rms_norm(x, weight, float(eps))[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, _, added = self.ops.npu_add_rms_norm(x, residual, weight, float(eps))
        return y, added


_TORCH = TorchNorm()


class RMSNorm(nn.Module):
    """``on_heads``: a q/k norm over [tokens, heads, head_dim] views of the fused projection, which stays on
    PyTorch's ops (the kernels take whole contiguous rows)."""

    def __init__(self, size: int, eps: float, *, on_heads: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.on_heads = on_heads
        self.method: TorchNorm = _TORCH

    def use_kernels(self, choice: KernelChoice) -> None:
        if self.on_heads:
            self.method = _TORCH
        elif choice.npu_ops is not None:
            self.method = NpuNorm(choice.npu_ops)
        elif choice.ops is not None:
            self.method = KernelNorm(choice.ops)
        else:
            self.method = _TORCH

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual) and its norm."""
        return self.method.add_and_norm(x, residual, self.weight, self.eps)
