"""The LoRA linear method: a layer's own method plus the batched low-rank delta of every adapter in the step.

Each wrapped layer holds ``max_loras`` slots of stacked weights. For a layer of n slices (q|k|v: 3, gate|up: 2,
o and down: 1) and slots R = max_lora_rank wide, a slot is w = n * R columns of the low-rank space: ``a`` is
[max_loras * w, in] and ``bt`` (B transposed) [max_loras * w, out], rows ordered (slot, slice, rank), and ``bt``
is block-diagonal by slice (slice s's rank rows write only slice s's output columns). Smaller ranks, untargeted
slices and empty slots are zeros.

A step's tokens are computed in two ways (``LoRAStepPlan``, built by the worker's LoRA manager):

* the leading rows of short sequences (the decodes, which the scheduler puts first) in one pass over the slots
  they use, with a mask [rows, slots * w] that keeps each token's own slot's columns::

      delta = ((x @ a.T) * mask) @ bt

  Per step, a wrapped layer costs two small matrix products whatever the adapters: on a CPU their dispatch, not
  their arithmetic, is what costs (per-slot gathers measured 2-7x slower at 32 rows);
* each longer chunk (a prefill) with its own slot's rows only, so a 512-token prefill pays for one adapter,
  not for every slot.

Every product with a zero is an exact zero, so each token gets its own adapter's delta and base tokens get
exactly nothing: a mixed batch gives each row what it gets alone. A step without LoRA tokens costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.models.layers.linear import Linear, LinearMethod


@dataclass(frozen=True)
class LoRAStepPlan:
    """Where one step's LoRA tokens are: the masked rows first, then chunks each run with one slot."""

    token_slot: torch.Tensor                 # [dense_rows] int64: slot of each masked row (-1: base model)
    num_slots: int                           # the masked rows use slots [0, num_slots)
    segments: tuple[tuple[int, int, int], ...] = ()   # (first row, end row, slot) of each chunk run alone
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)

    @property
    def dense_rows(self) -> int:
        return int(self.token_slot.shape[0])

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[dense_rows, num_slots * width]: 1 on the columns of the row's slot (made once per step and width)."""
        mask = self._masks.get(width)
        if mask is None:
            column_slot = torch.arange(self.num_slots * width, device=self.token_slot.device) // width
            mask = self._masks[width] = (self.token_slot[:, None] == column_slot[None, :]).to(dtype)
        return mask


class LoRAStepState:
    """The plan of the current step, shared by every wrapped layer (set by the worker's LoRA manager)."""

    def __init__(self) -> None:
        self.plan: LoRAStepPlan | None = None

    def set(self, plan: LoRAStepPlan | None) -> None:
        """``plan`` of this step; None: no token of the step runs an adapter."""
        self.plan = plan


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
        self.width = len(slices) * max_rank    # low-rank columns per slot
        self.a = torch.zeros(max_loras * self.width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras * self.width, sum(slices), dtype=dtype, device=device)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        plan = self.state.plan
        if plan is None:
            return out
        xa = x if x.dtype == self.a.dtype else x.to(self.a.dtype)
        rows = plan.dense_rows
        if rows:
            cols = plan.num_slots * self.width
            h = F.linear(xa[:rows], self.a[:cols]).mul_(plan.mask(self.width, self.a.dtype))
            self._add(out[:rows], h, self.bt[:cols])
        for start, end, slot in plan.segments:
            own = slice(slot * self.width, (slot + 1) * self.width)
            self._add(out[start:end], F.linear(xa[start:end], self.a[own]), self.bt[own])
        return out

    @staticmethod
    def _add(out: torch.Tensor, h: torch.Tensor, bt: torch.Tensor) -> None:
        if out.dtype == bt.dtype:
            out.addmm_(h, bt)
        else:   # --lora-dtype other than the model's
            out.add_(torch.mm(h, bt).to(out.dtype))

    def _rows(self, slot: int, part: int) -> slice:
        start = slot * self.width + part * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's (a [r, in], b [out_s, r]) of each slice (None: not targeted) into ``slot``."""
        if len(weights) != len(self.slices):
            raise ValueError(f"{len(weights)} slices given, the layer has {len(self.slices)}")
        self.clear_slot(slot)
        column = 0
        for part, (size, pair) in enumerate(zip(self.slices, weights)):
            if pair is not None:
                a, b = pair
                rows = self._rows(slot, part)
                rank = a.shape[0]
                self.a[rows.start:rows.start + rank].copy_(a)
                self.bt[rows.start:rows.start + rank, column:column + size].copy_(b.t())
            column += size

    def clear_slot(self, slot: int) -> None:
        own = slice(slot * self.width, (slot + 1) * self.width)
        self.a[own].zero_()
        self.bt[own].zero_()
