"""RMSNorm and SiLU-and-mul: the PyTorch ops and the CPU kernels they hand over to compute the same."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.device.kernel_choice import KernelChoice
from engine.models.layers.activation import SiluAndMul
from engine.models.layers.norm import KernelNorm, RMSNorm, TorchNorm


def _norm(ops: Any = None) -> RMSNorm:
    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48) + 0.5)
    norm.use_kernels(KernelChoice(ops=ops))
    return norm


def test_add_and_norm_is_the_unfused_add_then_norm() -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(7, 48), torch.randn(7, 48)
    norm = _norm()
    out, new_residual = norm.add_and_norm(x, residual)
    torch.testing.assert_close(new_residual, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(out, norm(residual + x), rtol=0, atol=0)


def test_kernels_compute_what_the_torch_ops_do(ops: Any) -> None:
    torch.manual_seed(1)
    plain, fused = _norm(), _norm(ops)
    with torch.no_grad():
        fused.weight.copy_(plain.weight)
    x, residual = torch.randn(9, 48), torch.randn(9, 48)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    expected, expected_residual = plain.add_and_norm(x, residual.clone())
    kept = residual.clone()
    out, new_residual = fused.add_and_norm(x, kept)
    assert new_residual is kept  # updated in place by the kernel
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_residual, expected_residual, rtol=1e-6, atol=1e-6)
    head_norm = RMSNorm(48, 1e-6, on_heads=True)  # q/k norms over head views: PyTorch's op even with kernels
    head_norm.use_kernels(KernelChoice(ops=ops))
    assert isinstance(head_norm.method, TorchNorm) and not isinstance(head_norm.method, KernelNorm)
    assert isinstance(fused.method, KernelNorm)
    heads = torch.randn(16, 5, 3, 48)[::2, :, 1]  # a strided view, as q is of the fused projection
    with torch.no_grad():
        head_norm.weight.copy_(plain.weight)
    torch.testing.assert_close(head_norm(heads), plain(heads), rtol=0, atol=0)


def test_silu_and_mul_both_ways(ops: Any) -> None:
    x = torch.randn(6, 64)
    plain, fused = SiluAndMul(), SiluAndMul()
    fused.use_kernels(KernelChoice(ops=ops))
    gate, up = x.split(32, dim=-1)
    torch.testing.assert_close(plain(x), F.silu(gate) * up, rtol=0, atol=0)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)
