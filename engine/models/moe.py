"""The sparse MLP block of the mixture-of-experts families: a router (``gate``), the routed experts
(:class:`~engine.models.layers.fused_moe.FusedMoE`) and optional shared experts that every token runs (DeepSeek's
``shared_experts``, Qwen2-MoE's ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``).

Over tensor-parallel ranks each rank holds a slice of every expert's intermediate size (or, with expert parallel,
whole experts: its share of them) and of the shared experts'; its routed and shared partial sums are added and
all-reduced once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import ParallelContext
from engine.models.layers.activation import SiluAndMul
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.linear import Linear
from engine.models.moe_config import MoeConfig


class MoeGate(nn.Module):
    """The router: float32 logits over every expert (its weight is kept in float32 whatever the model's dtype, as
    transformers keeps DeepSeek's; the scores decide which experts run)."""

    keeps_float32 = True

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class SharedExperts(nn.Module):
    """An MLP whose down projection is not reduced: its block adds it to the routed experts' partial sum first."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, intermediate_size: int, shared_intermediate_size: int,
                 expert_start: int, num_local_experts: int, parallel: ParallelContext) -> None:
        """``intermediate_size`` / ``shared_intermediate_size``: this rank's slices; ``expert_start`` and
        ``num_local_experts``: the routed experts it holds."""
        super().__init__()
        self.parallel = parallel
        self.gate = MoeGate(hidden_size, moe.routing.num_experts)
        self.experts = FusedMoE(moe.routing, hidden_size, intermediate_size, expert_start, num_local_experts)
        self.shared_experts = (SharedExperts(hidden_size, shared_intermediate_size)
                               if moe.shared_intermediate_size else None)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.parallel.tp_size > 1:
            out = self.parallel.all_reduce(out.contiguous())
        return out
