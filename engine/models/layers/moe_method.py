"""The interface of a mixture-of-experts layer's method (``FusedMoE.method``, chosen once per layer as a linear
layer's is), and the grouping of a step's (token, slot) pairs by expert that the methods share."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from engine.models.layers.moe_routing import select_experts

if TYPE_CHECKING:
    from engine.models.layers.fused_moe import FusedMoE


class FusedMoEMethod(ABC):
    """How one layer computes its experts for a step's tokens."""

    def route(self, layer: FusedMoE, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], global expert ids int64 [T, k]) of each token."""
        return select_experts(router_logits, layer.routing, layer.correction_bias)

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H] in x's dtype: the weighted sum over each token's experts that
        this rank holds (zeros for a token none of whose experts it holds)."""


def expert_order(topk_ids: torch.Tensor, expert_start: int, num_local: int, num_experts: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs routed to this rank's experts, grouped by local expert: (flat indices into
    ``topk_ids`` [P], sorted by expert, stable; each local expert's count, a host list)."""
    flat = topk_ids.reshape(-1)
    if expert_start == 0 and num_local == num_experts:
        local, pairs = flat, None
    else:  # expert parallel: only the pairs of the experts held here
        local = flat - expert_start
        pairs = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
        local = local.index_select(0, pairs)
    sorted_local, perm = torch.sort(local, stable=True)
    counts = torch.bincount(sorted_local, minlength=num_local).tolist()
    return (perm if pairs is None else pairs.index_select(0, perm)), counts
