"""Weight-only 4-bit (W4A16) weights in one internal form, whatever checkpoint format they came in (GPTQ, AWQ,
compressed-tensors ``pack-quantized``): ``Int4Weight``, unsigned 4-bit codes [out, in] with a float32 scale and zero
point per output row and input group, ``W[n, k] = (codes[n, k] - zeros[n, g(k)]) * scales[n, g(k)]``.

GPTQ's act-order checkpoints (``desc_act``) give each input channel its group through ``g_idx``, so a group's
channels are scattered. At load the input channels are sorted by group once (``perm``: a stable argsort of
``g_idx``), which makes every group ``group_size`` adjacent columns; the forward then reads ``x[:, perm]`` instead of
gathering scales per channel. ``dequantize`` undoes the permutation: it is the reference the kernels are tested
against, in the checkpoint's own column order.

The format readers (``engine.models.gptq``, ``engine.models.awq``, ``engine.models.ct_w4a16``) turn a projection's
packed tensors into an ``Int4Weight``; ``unpack_int32`` is the nibble unpacking they share.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.models.sharding import Shard

BITS = 4
PACK = 32 // BITS   # codes per int32
_SHIFTS = torch.arange(PACK, dtype=torch.int32) * BITS


def unpack_int32(packed: torch.Tensor, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """The 4-bit codes (uint8, 0..15) of an int32 tensor packing 8 along ``dim`` (0 or 1), code ``i`` of a word in
    bits ``4i..4i+3``: element ``8j + c`` of ``dim`` is nibble ``order.index(c)`` of word ``j`` (``order`` None:
    nibble ``c``, the GPTQ and compressed-tensors packing; AWQ's GEMM packing stores columns in its own order)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"expected int32 packed 4-bit codes, got {packed.dtype}")
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS) & 0xF      # [..., word, nibble]
    if order is not None:
        nibbles = nibbles[..., [list(order).index(c) for c in range(PACK)]]
    if dim == 1:
        codes = nibbles.reshape(packed.shape[0], packed.shape[1] * PACK)
    else:
        codes = nibbles.permute(0, 2, 1).reshape(packed.shape[0] * PACK, packed.shape[1])
    return codes.to(torch.uint8)


def pack_int32(codes: torch.Tensor, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """The inverse of ``unpack_int32`` (codes 0..15 of any integer dtype): for tests and tools writing checkpoints."""
    c = codes.to(torch.int32)
    if dim == 0:
        c = c.t()
    words = c.reshape(c.shape[0], -1, PACK)
    if order is not None:
        words = words[..., list(order)]
    packed = (words << _SHIFTS).sum(-1, dtype=torch.int64)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed.t().contiguous() if dim == 0 else packed.contiguous()


@dataclass
class Int4Weight:
    """An [out, in] weight as 4-bit codes in groups of ``group_size`` adjacent input columns (after ``perm``)."""

    codes: torch.Tensor                 # uint8 [out, in], 0..15, columns in ``perm`` order
    scales: torch.Tensor                # float32 [out, in // group_size]
    zeros: torch.Tensor                 # float32 [out, in // group_size], in code units
    group_size: int                     # columns per group (``in`` for one scale per output channel)
    perm: torch.Tensor | None = None    # int64 [in]: the kernel's column k is the checkpoint's column perm[k]
    # float32 [out, in // group_size]: when set, ``W = codes * scales + offsets`` (GGUF K-quants' additive minimum,
    # exact where a zero point ``-offset / scale`` would round, and defined for a scale of 0) and ``zeros`` is unused
    offsets: torch.Tensor | None = None
    # the model's dtype (its activations'): the dtype a kernel keeps its scale table in; None = float32
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        out, cols = self.codes.shape
        groups = cols // self.group_size
        if cols % self.group_size or self.scales.shape != (out, groups) or self.zeros.shape != (out, groups):
            raise ValueError(f"4-bit weight [{out}, {cols}]: scales {tuple(self.scales.shape)} and zeros "
                             f"{tuple(self.zeros.shape)} are not one per row and group of {self.group_size} columns")
        if self.offsets is not None and self.offsets.shape != (out, groups):
            raise ValueError(f"4-bit weight [{out}, {cols}]: offsets {tuple(self.offsets.shape)} are not one per row "
                             f"and group of {self.group_size} columns")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in] in the checkpoint's column order: ``(codes - zero) * scale`` per group."""
        out, cols = self.shape
        groups = cols // self.group_size
        codes = self.codes.float().view(out, groups, self.group_size)
        if self.offsets is not None:
            w = (codes * self.scales.unsqueeze(-1) + self.offsets.unsqueeze(-1)).view(out, cols)
        else:
            w = ((codes - self.zeros.unsqueeze(-1)) * self.scales.unsqueeze(-1)).view(out, cols)
        if self.perm is None:
            return w
        unpermuted = torch.empty_like(w)
        unpermuted[:, self.perm] = w
        return unpermuted

    def take(self, shard: Shard, name: str) -> Int4Weight:
        """This tensor-parallel rank's part: rows (a column-parallel layer) or input columns (a row-parallel one).
        Raises ValueError naming ``name`` when the columns would split a group, or an act-order weight (whose groups
        are scattered over the columns) would have to split its columns."""
        if shard.dim is None:
            return self
        end = shard.start + shard.size
        if shard.dim == 0:
            return replace(self, codes=self.codes[shard.start:end], scales=self.scales[shard.start:end],
                           zeros=self.zeros[shard.start:end],
                           offsets=None if self.offsets is None else self.offsets[shard.start:end])
        cols = self.shape[1]
        if self.perm is not None:
            raise ValueError(f"{name}: an act-order (desc_act) 4-bit weight cannot split its input columns over "
                             "tensor-parallel ranks (its groups are scattered over them); use tensor_parallel_size "
                             "1 or a checkpoint without desc_act")
        if self.group_size == cols:   # one group per row: every column slice keeps the row's scale and zero
            return replace(self, codes=self.codes[:, shard.start:end], group_size=shard.size)
        if shard.start % self.group_size or shard.size % self.group_size:
            raise ValueError(f"{name}: tensor-parallel ranks of {shard.size} input columns would split its groups of "
                             f"{self.group_size}; use a tensor_parallel_size whose shards hold whole groups")
        g0, g1 = shard.start // self.group_size, end // self.group_size
        return replace(self, codes=self.codes[:, shard.start:end], scales=self.scales[:, g0:g1],
                       zeros=self.zeros[:, g0:g1], offsets=None if self.offsets is None else self.offsets[:, g0:g1])

    @staticmethod
    def cat(parts: Sequence[Int4Weight], name: str) -> Int4Weight:
        """The parts of a fused projection (q/k/v, gate/up) stacked by rows. They read one input, so they must
        share its column order and group size (ValueError naming ``name`` otherwise)."""
        first = parts[0]
        for p in parts[1:]:
            same_perm = (p.perm is None and first.perm is None) or (
                p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm))
            if p.group_size != first.group_size or p.shape[1] != first.shape[1] or not same_perm:
                raise ValueError(f"{name}: the parts of a fused projection differ in group size or act-order "
                                 "permutation (g_idx); they must share them to run as one layer")
            if (p.offsets is None) != (first.offsets is None):
                raise ValueError(f"{name}: the parts of a fused projection mix zero points and additive offsets")
        offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts if p.offsets is not None])
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]), first.group_size, first.perm, offsets)

    def pad_rows(self, rows: int) -> Int4Weight:
        """Rows of weight 0 appended up to ``rows`` (a vocabulary-parallel lm_head's padding)."""
        extra = rows - self.shape[0]
        return replace(self, codes=torch.cat([self.codes, self.codes.new_zeros(extra, self.shape[1])]),
                       scales=torch.cat([self.scales, self.scales.new_zeros(extra, self.scales.shape[1])]),
                       zeros=torch.cat([self.zeros, self.zeros.new_zeros(extra, self.zeros.shape[1])]),
                       offsets=None if self.offsets is None else
                       torch.cat([self.offsets, self.offsets.new_zeros(extra, self.offsets.shape[1])]))

    def to(self, device: torch.device) -> Int4Weight:
        return Int4Weight(self.codes.to(device), self.scales.to(device), self.zeros.to(device), self.group_size,
                          None if self.perm is None else self.perm.to(device),
                          None if self.offsets is None else self.offsets.to(device), self.dtype)


def from_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                g_idx: torch.Tensor | None, name: str) -> Int4Weight:
    """An ``Int4Weight`` from codes [out, in] in the checkpoint's column order, per-group ``scales`` and ``zeros``
    [out, groups] and the group of each input column (``g_idx``; None: ``k // group_size``). Columns are sorted by
    group when ``g_idx`` is not that; ValueError naming ``name`` when its groups are not all ``group_size``
    columns."""
    cols = codes.shape[1]
    plain = torch.arange(cols) // group_size
    if g_idx is None or torch.equal(g_idx.long(), plain):
        return Int4Weight(codes.contiguous(), scales.float().contiguous(), zeros.float().contiguous(), group_size)
    g = g_idx.long()
    if g.shape != (cols,):
        raise ValueError(f"{name}: g_idx has shape {tuple(g.shape)}, expected ({cols},)")
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], plain):
        raise ValueError(f"{name}: g_idx does not give every group {group_size} input columns")
    return Int4Weight(codes[:, perm].contiguous(), scales.float().contiguous(), zeros.float().contiguous(),
                      group_size, perm)
