"""A mixture-of-experts layer's routed experts on an Ascend NPU (:class:`NpuMoEMethod`), mapped to torch-npu's
operators as vLLM-Ascend's all-gather path ran them (``TokenDispatcherWithAllGather`` in
``vllm_ascend/ops/moe_dispatcher/token_dispatcher.py`` and ``unquant_apply_mlp`` in ``ops/layers/moe_mlp.py``, at
the parent of vllm-ascend commit f86596a, which moved that path to ``npu_moe_init_routing_v2`` /
``npu_moe_token_unpermute``):

* routing: ``npu_moe_gating_top_k_softmax`` (softmax, top-k; renormalised and scaled after, as vLLM-Ascend does)
  when the layer's routing is plain softmax top-k; otherwise the base class's ``route`` (sigmoid, grouped,
  noaux_tc), with the ``row_idx`` the gating operator would have written (``row_idx[t, j] = j * T + t``);
* ``npu_moe_init_routing`` sorts the (token, slot) pairs by expert and gathers their rows; ``npu_moe_compute_
  expert_tokens`` gives each local expert's cumulative row end (``group_list``, group_list_type 0);
* ``npu_grouped_matmul`` with ``w13`` seen as [E, H, 2I] (a transposed view of the layer's weight, which the
  operator takes without a copy), ``npu_swiglu``, ``npu_grouped_matmul`` with ``w2`` as [E, I, H];
* ``npu_moe_finalize_routing`` scales each row by its routing weight (in the model's dtype, as the operator
  requires) and sums every token's rows back.

Expert parallelism: ids outside this rank's experts become ``num_local_experts``, one past the last local
expert, so they sort after every held row and fall outside ``group_list``. The grouped matmul must cover all of
its rows, so only the first ``group_list[-1]`` rows go through the experts (one device-to-host read per step, only
under expert parallelism) and the rest come back as zeros, which finalize_routing adds nothing from.

``npu_ops`` is the ``torch_npu`` module the NPU device hands over (``KernelChoice.npu_ops``). No hardware has run
this: the calls are checked against a test-only twin of the operators written from torch-npu's documentation
(tests/engine/npu_twin/moe.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.models.layers.moe_method import FusedMoEMethod

if TYPE_CHECKING:
    from engine.models.layers.fused_moe import FusedMoE


class NpuMoEMethod(FusedMoEMethod):
    """A MoE layer's experts through torch-npu's MoE operators (see the module docstring)."""

    def __init__(self, layer: FusedMoE, npu_ops: Any) -> None:
        self.ops = npu_ops
        routing = layer.routing
        self.fused_gating = (routing.scoring == "softmax" and not routing.correction_bias
                             and (routing.num_groups is None or routing.num_groups == 1))
        self.expert_parallel = layer.num_local_experts != routing.num_experts

    def _gate(self, layer: FusedMoE, router_logits: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], global ids int32 [T, k], row_idx int32 [T, k])."""
        routing = layer.routing
        if self.fused_gating:
            weights, ids, row_idx = self.ops.npu_moe_gating_top_k_softmax(router_logits, k=routing.top_k)
            weights = weights.float()
            if routing.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if routing.routed_scaling_factor != 1.0:
                weights = weights * routing.routed_scaling_factor
            return weights, ids, row_idx
        weights, ids = self.route(layer, router_logits)
        tokens, k = ids.shape
        row_idx = torch.arange(tokens * k, dtype=torch.int32, device=ids.device).view(k, tokens).t().contiguous()
        return weights, ids.to(torch.int32), row_idx

    def apply(self, layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids, row_idx = self._gate(layer, router_logits)
        num_local = layer.num_local_experts
        if self.expert_parallel:
            local = ids - layer.expert_start
            ids = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local))
        tokens = x.shape[0]
        expanded_x, expanded_row_idx, expanded_ids = self.ops.npu_moe_init_routing(x, row_idx, ids, tokens)
        group_list = self.ops.npu_moe_compute_expert_tokens(expanded_ids, num_local).to(torch.int64)
        rows = expanded_x
        if self.expert_parallel:
            rows = expanded_x[: int(group_list[-1])]
        if rows.shape[0] > 0:
            y = self._experts(layer, rows, group_list)
        else:  # none of these tokens' experts are held here
            y = rows.new_empty(0, layer.hidden_size)
        if y.shape[0] < expanded_x.shape[0]:
            y = torch.cat((y, y.new_zeros(expanded_x.shape[0] - y.shape[0], y.shape[1])))
        return self.ops.npu_moe_finalize_routing(y, None, None, None, weights.to(x.dtype), expanded_row_idx, None,
                                                 drop_pad_mode=0)

    def _experts(self, layer: FusedMoE, rows: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(rows)) * up(rows))`` of the rows grouped by local expert."""
        h = self.ops.npu_grouped_matmul([rows], [layer.w13.transpose(1, 2)], group_list=group_list, split_item=2,
                                        group_type=0, group_list_type=0)[0]
        h = self.ops.npu_swiglu(h)
        return self.ops.npu_grouped_matmul([h], [layer.w2.transpose(1, 2)], group_list=group_list, split_item=2,
                                           group_type=0, group_list_type=0)[0]
