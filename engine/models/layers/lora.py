"""The LoRA linear method: a layer's own method plus the batched low-rank delta of every adapter in the step.

Each wrapped layer holds ``max_loras`` slots of stacked weights. For a layer of n slices (q|k|v: 3, gate|up: 2,
o and down: 1) and slots R = max_lora_rank wide, ``a`` is [n * max_loras * R, in] (rows ordered slice, slot,
rank) and ``b`` is [out, n * max_loras * R], block-diagonal by slice: slice s's output rows read only slice s's
columns. Smaller ranks, untargeted slices and empty slots are zeros. One step's tokens share one mask
[num_tokens, max_loras * R] (ones on the columns of the token's slot, none for base tokens), repeated per slice:

    delta = ((x @ a.T) * mask) @ b.T

Every product with a zero is an exact zero, so each token gets its own adapter's delta and base tokens get
exactly nothing: a mixed batch gives each row what it gets alone. A step without LoRA tokens costs nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.layers.linear import Linear, LinearMethod


class LoRAStepState:
    """The mask of the current step, shared by every wrapped layer (set by the worker's LoRA manager)."""

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None
        self._repeated: dict[int, torch.Tensor] = {}

    def set(self, mask: torch.Tensor | None) -> None:
        """``mask`` [num_tokens, max_loras * R] for this step; None: no token of the step runs an adapter."""
        self._mask = mask
        self._repeated = {}

    def mask(self, num_slices: int) -> torch.Tensor | None:
        """The step's mask repeated for a layer of ``num_slices`` slices (made once per step and slice count)."""
        if self._mask is None or num_slices == 1:
            return self._mask
        repeated = self._repeated.get(num_slices)
        if repeated is None:
            repeated = self._repeated[num_slices] = self._mask.repeat(1, num_slices)
        return repeated


class LoRALinearMethod(LinearMethod):
    """``base`` (the method the layer chose in ``use_kernels``) plus the step's LoRA delta."""

    def __init__(self, base: LinearMethod, state: LoRAStepState, *, slices: tuple[int, ...], in_features: int,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.base = base
        self.reads_weight = base.reads_weight
        self.state = state
        self.slices = slices          # output rows of each slice (q, k, v sizes for the fused qkv_proj)
        self.max_loras = max_loras
        self.max_rank = max_rank
        width = len(slices) * max_loras * max_rank
        self.a = torch.zeros(width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(sum(slices), width, dtype=dtype, device=device)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        mask = self.state.mask(len(self.slices))
        if mask is None:
            return out
        h = F.linear(x if x.dtype == self.a.dtype else x.to(self.a.dtype), self.a)
        delta = F.linear(h.mul_(mask), self.b)
        return out.add_(delta) if delta.dtype == out.dtype else out.add_(delta.to(out.dtype))

    def _columns(self, slot: int, part: int) -> slice:
        start = (part * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's (a [r, in], b [out_s, r]) of each slice (None: not targeted) into ``slot``."""
        if len(weights) != len(self.slices):
            raise ValueError(f"{len(weights)} slices given, the layer has {len(self.slices)}")
        self.clear_slot(slot)
        row = 0
        for part, (size, pair) in enumerate(zip(self.slices, weights)):
            if pair is not None:
                a, b = pair
                cols = self._columns(slot, part)
                rank = a.shape[0]
                self.a[cols.start:cols.start + rank].copy_(a)
                self.b[row:row + size, cols.start:cols.start + rank].copy_(b)
            row += size

    def clear_slot(self, slot: int) -> None:
        for part in range(len(self.slices)):
            cols = self._columns(slot, part)
            self.a[cols].zero_()
            self.b[:, cols].zero_()
