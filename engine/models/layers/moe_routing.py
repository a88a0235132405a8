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

import torch

from engine.models.moe_config import Routing


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
