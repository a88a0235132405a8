"""TEST-ONLY TWIN of torch-npu's fused layer operators, on the CPU, from the Ascend Extension for PyTorch API
reference (6.0.0 / 7.0.0): ``npu_rms_norm``, ``npu_add_rms_norm``, ``npu_swiglu``, ``npu_rotary_mul``. Their first
argument is named ``self`` in the documented schema (callers pass it positionally)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.engine.npu_twin._ops import operator, require, require_dtype

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _check_norm(op: str, x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> None:
    require_dtype("x", op, x, FLOATS)
    require(gamma.dtype in (x.dtype, torch.float32), f"{op}: gamma must have x's dtype {x.dtype} (or float32), got "
                                                     f"{gamma.dtype}", TypeError)
    require(1 <= gamma.dim() <= x.dim() and tuple(x.shape[x.dim() - gamma.dim():]) == tuple(gamma.shape),
            f"{op}: gamma's shape {tuple(gamma.shape)} must be x's last dimensions (x is {tuple(x.shape)})")
    require(isinstance(epsilon, float) and epsilon > 0, f"{op}: epsilon must be a positive float, got {epsilon!r}",
            TypeError)


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rstd * gamma, with rstd = 1 / sqrt(mean(x^2) + epsilon) over gamma's dimensions (float32)."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    # Normalised, rounded to x's dtype, then scaled by gamma: the order transformers' RMSNorm uses.
    return (gamma * (xf * rstd).to(x.dtype)).to(x.dtype), rstd


@operator
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y like x, rstd float32 with gamma's dimensions kept as 1)."""
    _check_norm("npu_rms_norm", self, gamma, epsilon)
    return _rms_norm(self, gamma, epsilon)


@operator
def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x = x1 + x2, then RMSNorm of x. Returns (y, rstd, x)."""
    op = "npu_add_rms_norm"
    require(x1.shape == x2.shape, f"{op}: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have one shape")
    require(x1.dtype == x2.dtype, f"{op}: x1 and x2 must have one dtype, got {x1.dtype} and {x2.dtype}", TypeError)
    _check_norm(op, x1, gamma, epsilon)
    x = x1 + x2
    y, rstd = _rms_norm(x, gamma, epsilon)
    return y, rstd, x


@operator
def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: ``self`` split in halves A, B along ``dim``; returns ``silu(A) * B``."""
    op = "npu_swiglu"
    require_dtype("x", op, self, FLOATS)
    require(isinstance(dim, int) and -self.dim() <= dim < self.dim(), f"{op}: dim {dim!r} out of range", TypeError)
    require(self.shape[dim] % 2 == 0, f"{op}: dimension {dim} ({self.shape[dim]}) must be even")
    a, b = self.chunk(2, dim=dim)
    return F.silu(a) * b


@operator
def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """Rotary embedding, rotate-half form: ``x * r1 + rotate_half(x) * r2`` with x 4-D ([B, S, N, D], [B, N, S, D]
    or [S, B, N, D]) and r1 (cos) / r2 (sin) 4-D, x's dtype, D wide, broadcast over x with one head (N = 1)."""
    op = "npu_rotary_mul"
    require(rotary_mode == "half", f"{op} twin: rotary_mode {rotary_mode!r} is not modelled (half)")
    require_dtype("x", op, self, FLOATS)
    require(self.dim() == 4, f"{op}: x must be 4-D, got {tuple(self.shape)}")
    require(self.shape[-1] % 2 == 0, f"{op}: D {self.shape[-1]} must be even")
    for name, r in (("r1", r1), ("r2", r2)):
        require(r.dtype == self.dtype, f"{op}: {name} must have x's dtype {self.dtype}, got {r.dtype}", TypeError)
        require(r.dim() == 4 and r.shape[-1] == self.shape[-1],
                f"{op}: {name} must be 4-D with x's D={self.shape[-1]}, got {tuple(r.shape)}")
        require(all(rd in (1, xd) for rd, xd in zip(r.shape, self.shape)) and 1 in (r.shape[1], r.shape[2]),
                f"{op}: {name} {tuple(r.shape)} must broadcast over x {tuple(self.shape)} with one head")
    require(r1.shape == r2.shape, f"{op}: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have one shape")
    x1, x2 = self.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return self * r1 + rotated * r2
