"""Weights kept in llama.cpp's block-quantized form (Q4_0, Q4_1, Q8_0) for the CPU ``quant_linear`` kernel.

A GGUF file's quantized tensors are dequantized to float32 at load (that is what transformers does with
the same file); on the CPU with the kernels built, the projections then run on the blocks (a Q4_1 weight is
5 bits in the file and 32 once dequantized) and the float32 copies are freed, unless
``SLUICE_QUANT_MAX_ROWS`` caps the rows (engine/models/llama.py). The kernel expands the codes into float32
in cache and accumulates in float32, so it computes the dequantized matmul (same values, summed in another
order).

Each block of 32 weights along the input dimension has one scale (and, for Q4_1, one offset); they are
stored here as float16 [out, in/32] (as in the file) next to the codes, which keep ggml's byte order.
(Q4_K tensors run on the int4 kernel instead, and Q5_K / Q6_K dequantized: engine.models.gguf_kquants.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

BLOCK = 32

# GGUF type -> (our format, bytes per block)
_FORMATS = {
    GGMLQuantizationType.Q4_0: ("u4", 18),
    GGMLQuantizationType.Q4_1: ("u4", 20),
    GGMLQuantizationType.Q8_0: ("s8", 34),
}


@dataclass
class QuantWeight:
    """An [out, in] weight as block codes: ``u4`` w = scale * code + min (code 0..15, two per byte),
    ``s8`` w = scale * code (code -128..127; ``mins`` is empty)."""

    format: str
    codes: torch.Tensor   # u4: uint8 [out, in/2]; s8: int8 [out, in]
    scales: torch.Tensor  # float16 [out, in/32]
    mins: torch.Tensor    # float16 [out, in/32] (u4) or empty (s8)

    @property
    def shape(self) -> tuple[int, int]:
        per_byte = 2 if self.format == "u4" else 1
        return self.codes.shape[0], self.codes.shape[1] * per_byte

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: what the kernel multiplies by (for tests and checks)."""
        out, k = self.shape
        if self.format == "u4":
            c = self.codes.view(out, k // BLOCK, BLOCK // 2)
            codes = torch.cat([c & 0x0F, c >> 4], dim=-1).float()
            w = codes * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
        else:
            w = self.codes.view(out, k // BLOCK, BLOCK).float() * self.scales.float().unsqueeze(-1)
        return w.reshape(out, k)


def supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in _FORMATS


def from_gguf_blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> QuantWeight:
    """``raw``: a GGUF tensor's bytes as uint8 [rows, bytes per row] (``ReaderTensor.data``)."""
    fmt, block_bytes = _FORMATS[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16).reshape(rows, -1)
    if qtype == GGMLQuantizationType.Q4_1:
        mins = blocks[..., 2:4].copy().view(np.float16).reshape(rows, -1)
        codes = blocks[..., 4:].reshape(rows, -1).copy()
    elif qtype == GGMLQuantizationType.Q4_0:  # codes are offset by 8: w = d * (q - 8), exact in float16
        mins = (-8.0 * scales.astype(np.float32)).astype(np.float16)
        codes = blocks[..., 2:].reshape(rows, -1).copy()
    else:
        mins = np.empty((0,), np.float16)
        codes = blocks[..., 2:].reshape(rows, -1).copy().view(np.int8)
    return QuantWeight(fmt, torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales)),
                       torch.from_numpy(np.ascontiguousarray(mins)))


def permute_rows(weight: QuantWeight, permute) -> QuantWeight:
    """Applies a numpy row permutation (``unpermute_qk``) to every part of ``weight``."""
    mins = (weight.mins if weight.format == "s8"
            else torch.from_numpy(np.ascontiguousarray(permute(weight.mins.numpy()))))
    return QuantWeight(weight.format, torch.from_numpy(np.ascontiguousarray(permute(weight.codes.numpy()))),
                       torch.from_numpy(np.ascontiguousarray(permute(weight.scales.numpy()))), mins)


def cat_rows(parts: Sequence[QuantWeight]) -> QuantWeight | None:
    """Stacks the shards of a fused projection (q|k|v, gate|up); None if their formats differ."""
    fmt = parts[0].format
    if any(p.format != fmt or p.shape[1] != parts[0].shape[1] for p in parts):
        return None
    mins = parts[0].mins if fmt == "s8" else torch.cat([p.mins for p in parts])
    return QuantWeight(fmt, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins)


def pad_rows(weight: QuantWeight, rows: int) -> QuantWeight:
    """``weight`` with zero rows appended up to ``rows`` (zero codes, scales and mins: weights of exactly 0), for a
    vocabulary-parallel lm_head's padding."""
    extra = rows - weight.shape[0]

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

    return QuantWeight(weight.format, pad(weight.codes), pad(weight.scales),
                       weight.mins if weight.format == "s8" else pad(weight.mins))
