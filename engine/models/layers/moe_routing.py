"""Which experts each token goes to, and with what weight: the routing functions of the mixture-of-experts models,
computed exactly as transformers computes them (``modeling_mixtral``, ``modeling_qwen2_moe`` / ``qwen3_moe``,
``modeling_deepseek_v2`` / ``v3``), in float32.

* Mixtral, Qwen2-MoE, Qwen3-MoE: softmax over the experts, top-k, optionally renormalised (``norm_topk_prob``;
  Mixtral always).
* DeepSeek-V2 (``topk_method`` "greedy" / "group_limited_greedy"): softmax, top-k over all experts or over the
  ``topk_group`` groups whose best expert scores highest; weights times ``routed_scaling_factor``.
* DeepSeek-V3 / R1 / Kimi-K2 (``topk_method`` "noaux_tc"): sigmoid scores, the selection made on scores plus the
  ``e_score_correction_bias`` over the ``topk_group`` groups whose two best biased scores sum highest; the weights
  are the unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Scoring = Literal["softmax", "sigmoid"]
# How a group of experts is scored for grouped top-k: its best expert ("max", DeepSeek-V2's group_limited_greedy)
# or the sum of its two best biased scores ("top2_sum", DeepSeek-V3's noaux_tc).
GroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False
    num_groups: int | None = None          # grouped top-k: experts split in this many groups ...
    topk_group: int | None = None          # ... of which this many are kept
    group_score: GroupScore = "max"
    correction_bias: bool = False          # noaux_tc: gate.e_score_correction_bias shifts the choice, not the weight
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the {self.num_experts} experts")
        if (self.num_groups is None) != (self.topk_group is None):
            raise ValueError("grouped top-k needs both n_group and topk_group")
        if self.num_groups is not None and self.topk_group is not None:
            if self.num_experts % self.num_groups:
                raise ValueError(f"n_group {self.num_groups} does not divide the {self.num_experts} experts")
            if not 0 < self.topk_group <= self.num_groups:
                raise ValueError(f"topk_group {self.topk_group} must be between 1 and n_group {self.num_groups}")
            if self.topk_group * (self.num_experts // self.num_groups) < self.top_k:
                raise ValueError(f"topk_group {self.topk_group} groups of {self.num_experts // self.num_groups} "
                                 f"experts hold fewer than num_experts_per_tok {self.top_k}")


def select_experts(router_logits: torch.Tensor, routing: Routing,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k])."""
    logits = router_logits.float()
    scores = logits.sigmoid() if routing.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores
    if routing.correction_bias:
        if correction_bias is None:
            raise ValueError("this routing needs gate.e_score_correction_bias")
        choice = scores + correction_bias.float()
    if routing.num_groups is not None and routing.topk_group is not None and routing.num_groups > 1:
        tokens, groups = choice.shape[0], routing.num_groups
        grouped = choice.view(tokens, groups, -1)
        if routing.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)
        # noaux_tc masks the dropped groups to -inf (biased scores may be negative); group_limited_greedy to 0
        choice = choice.masked_fill(~expert_mask, float("-inf") if routing.correction_bias else 0.0)
    if choice is scores:  # plain top-k
        weights, ids = torch.topk(scores, k=routing.top_k, dim=-1)
    else:
        ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if routing.scoring == "sigmoid" else 0.0))
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids
