"""The routed experts of a mixture-of-experts layer, and the methods that compute them.

A :class:`FusedMoE` holds this rank's experts stacked: ``w13`` [E_local, 2 * I, H] (each expert's gate rows, then
its up rows) and ``w2`` [E_local, H, I], where E_local is the experts it holds (all of them, or its share under
expert parallelism, global ids ``expert_start`` ..) and I its slice of each expert's intermediate size (all of it,
or its share under tensor parallelism). It routes (``moe_routing.select_experts``), then its
:class:`FusedMoEMethod`, picked once in ``use_kernels`` as a linear layer's method is, computes
``sum_k weight_k * down(silu(gate(x)) * up(x))`` over the experts of each token that this rank holds. The partial
sums of several ranks are added by the caller (one all-reduce with the shared experts' and the rest of the layer's).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.device.kernel_choice import KernelChoice
from engine.models.layers.activation import silu_and_mul
from engine.models.layers.linear import Linear, LinearMethod, linear, onednn_linear, onednn_pack, w8a8_method
from engine.models.layers.moe_method import FusedMoEMethod, expert_order
from engine.models.moe_config import Routing
from engine.models.w8a8 import Int8Weight, quantize_weight


class GroupedMoEMethod(FusedMoEMethod):
    """Tokens grouped by expert, then each active expert's two products over its rows, scaled by the routing weights
    and summed back per token (``index_add_``): what transformers' eager loop computes, with one sort instead of a
    mask per expert. ``w13`` / ``w2`` are per-expert lists of oneDNN-packed copies when ``packed`` (the CPU's
    choice), else slices of the layer's stacked weights through ``linear``.

    The per-expert loop runs only the products: every gate/up product first, then one SiLU-and-mul over all the
    rows, then every down product, then one scale and one ``index_add_``. At 32 decode rows nearly every expert
    of 64 holds ~4 rows, and each small op of a 2-thread step is a parallel region that waits for both threads:
    on 2 shared cores a layer at 32 rows took 29.0 ms this way against 30.1 ms with the activation, scaling and
    sum per expert, and 81 against 145 ms (327-337 against 1154-1172 at 128 rows) while another process held a
    core (docs/benchmarks.md, "Mixture of experts")."""

    def __init__(self, layer: FusedMoE, onednn: bool, ops: Any = None) -> None:
        """``ops``: the compiled CPU kernels (their one-pass SiLU-and-mul), or None."""
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        if onednn:
            self.packed = ([onednn_pack(w) for w in layer.w13], [onednn_pack(w) for w in layer.w2])
        self.act: Any = silu_and_mul if ops is None else ops.silu_and_mul

    def _gate_up(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:
        return onednn_linear(rows, self.packed[0][e]) if self.packed is not None else linear(rows, layer.w13[e])

    def _down(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:
        return onednn_linear(rows, self.packed[1][e]) if self.packed is not None else linear(rows, layer.w2[e])

    def apply(self, layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(layer, router_logits)
        k = ids.shape[1]
        order, counts = expert_order(ids, layer.expert_start, layer.num_local_experts, layer.routing.num_experts)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if not order.numel():   # expert parallel: none of these tokens' experts is held here
            return out.to(x.dtype)
        tokens = order // k
        rows_in = x.index_select(0, tokens)
        spans: list[tuple[int, int, int]] = []   # (local expert, its first row, one past its last) in ``rows_in``
        start = 0
        for e, n in enumerate(counts):
            if n:
                spans.append((e, start, start + n))
                start += n
        h = self.act(torch.cat([self._gate_up(layer, e, rows_in[a:b]) for e, a, b in spans]))
        y = torch.cat([self._down(layer, e, h[a:b]) for e, a, b in spans])
        scale = weights.reshape(-1).index_select(0, order)
        out.index_add_(0, tokens, y.float().mul_(scale[:, None]))
        return out.to(x.dtype)


# What an expert's int8 linear methods read as their layer: no bias.
_BIASLESS = Linear(1, 1, bias=False)


class Int8GroupedMoEMethod(GroupedMoEMethod):
    """W8A8 experts (``--quantization w8a8``, or a compressed-tensors int8 checkpoint): the grouping of
    :class:`GroupedMoEMethod`, each active expert's two products by the W8A8 method of its int8 weights (oneDNN's int8
    GEMM, or the portable exact one: ``linear.w8a8_method``), activations quantized per token as every W8A8 layer's."""

    def __init__(self, layer: FusedMoE, choice: KernelChoice) -> None:
        assert layer.int8 is not None
        self.packed = None
        self.act = silu_and_mul if choice.ops is None else choice.ops.silu_and_mul
        self.w13: list[LinearMethod] = [w8a8_method(w, choice) for w in layer.int8[0]]
        self.w2: list[LinearMethod] = [w8a8_method(w, choice) for w in layer.int8[1]]

    def _gate_up(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.w13[e].apply(_BIASLESS, rows)

    def _down(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.w2[e].apply(_BIASLESS, rows)


class FusedMoE(nn.Module):
    """This rank's routed experts of one layer (see the module docstring)."""

    def __init__(self, routing: Routing, hidden_size: int, intermediate_size: int, expert_start: int = 0,
                 num_local_experts: int | None = None) -> None:
        super().__init__()
        self.routing = routing
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size   # this rank's slice of each expert's
        self.expert_start = expert_start
        self.num_local_experts = routing.num_experts if num_local_experts is None else num_local_experts
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        # DeepSeek-V3's gate.e_score_correction_bias (float32 in any model dtype), on the layer that routes
        self.correction_bias = (nn.Parameter(torch.empty(routing.num_experts), requires_grad=False)
                                if routing.correction_bias else None)
        self.method: FusedMoEMethod = GroupedMoEMethod(self, onednn=False)
        # W8A8: each local expert's int8 w13 and w2, set before ``use_kernels`` (the float weights then freed)
        self.int8: tuple[list[Int8Weight], list[Int8Weight]] | None = None

    def quantize_w8a8(self) -> None:
        """Every expert's weights quantized per output channel (``w8a8.quantize_weight``); the float ones freed."""
        self.int8 = ([quantize_weight(w) for w in self.w13], [quantize_weight(w) for w in self.w2])
        self._free_float()

    def _free_float(self) -> None:
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def use_kernels(self, choice: KernelChoice) -> None:
        self.method = choose_moe_method(self, choice)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, router_logits)

    def extra_repr(self) -> str:
        return (f"experts={self.expert_start}..{self.expert_start + self.num_local_experts - 1} of "
                f"{self.routing.num_experts}, top_k={self.routing.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}")


def choose_moe_method(layer: FusedMoE, choice: KernelChoice) -> FusedMoEMethod:
    """The method of one MoE layer, from the device's choice: torch-npu's MoE operators on the NPU, the Triton
    fused-MoE kernels on CUDA (where triton imports), oneDNN-packed experts on the CPU when linears are packed,
    PyTorch's products otherwise. The accelerators' modules are imported only when chosen."""
    if layer.int8 is not None:
        if choice.npu_ops is not None or choice.triton_moe:
            raise ValueError("W8A8 experts run on the CPU only: the NPU's grouped int8 matmul and a CUDA int8 MoE "
                             "kernel are not wired (quantization w8a8 on a mixture-of-experts model)")
        return Int8GroupedMoEMethod(layer, choice)
    if choice.npu_ops is not None:
        from engine.models.layers.fused_moe_npu import NpuMoEMethod

        return NpuMoEMethod(layer, choice.npu_ops)
    if choice.triton_moe:
        from engine.models.layers.fused_moe_triton import TritonMoEMethod

        return TritonMoEMethod()
    cpu = layer.w13.device.type == "cpu"
    return GroupedMoEMethod(layer, onednn=choice.onednn and cpu, ops=choice.ops if cpu else None)


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum computed token by token in float32 (tests' and kernels' reference): every expert
    id in ``ids`` indexes ``w13`` / ``w2``."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = F.linear(x[t].float(), w13[e].float())
            y = F.linear(silu_and_mul(h), w2[e].float())
            out[t] += float(weights[t, slot]) * y
    return out
