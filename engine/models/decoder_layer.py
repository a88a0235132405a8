"""The decoder layer of every model family, and the blocks it is made of: attention over this rank's heads (q/k/v
fused into one Linear, optional q/k/v and o biases, Qwen3's per-head q/k RMSNorm) or DeepSeek's latent attention
(``engine.models.mla``), and a dense MLP (gate/up fused into one Linear) or a mixture-of-experts block
(``engine.models.moe``), chosen per layer from the model's config. The residual stream is carried beside the hidden
states (vLLM's layout) so that each residual add is fused into the RMSNorm after it.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.distributed import ParallelContext
from engine.models.config import ModelConfig
from engine.models.layers.activation import GeluAndMul, SiluAndMul
from engine.models.layers.fused_moe import FusedMoE
from engine.models.layers.linear import Linear, RowParallelLinear
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding
from engine.models.mla import MlaAttention
from engine.models.moe import SparseMoeBlock
from engine.models.sharding import ShardPlan


def _row_linear(in_features: int, out_features: int, bias: bool, parallel: ParallelContext) -> Linear:
    """o_proj / down_proj: row-parallel over the tensor ranks, a plain Linear without tensor parallelism."""
    if parallel.tp_size > 1:
        return RowParallelLinear(in_features, out_features, bias, parallel)
    return Linear(in_features, out_features, bias=bias)


class Attention(nn.Module):
    """Self-attention over this rank's query heads and the KV heads they read (``plan``)."""

    def __init__(self, config: ModelConfig, plan: ShardPlan, rotary: RotaryEmbedding | None,
                 parallel: ParallelContext, window: int | None = None) -> None:
        """``window``: this layer's sliding window (None: full attention); ``rotary`` None: no position rotation
        (SmolLM3's NoPE layers)."""
        super().__init__()
        self.config = config
        self.window = window
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.q_size, self.kv_size = plan.q_size, plan.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = _row_linear(self.q_size, config.hidden_size, config.o_proj_bias, parallel)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, on_heads=True) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, on_heads=True) if config.qk_norm else None
        self.rotary = rotary  # shared by the layers of its kind; its buffers are not persistent
        self.scale = config.attn_scale if config.attn_scale is not None else config.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        head_dim = self.config.head_dim
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, head_dim)
        k = k.view(num_tokens, self.num_kv_heads, head_dim)
        v = v.view(num_tokens, self.num_kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, self.window,
                                   self.config.attn_logit_softcapping)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, plan: ShardPlan, parallel: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * plan.intermediate_size, bias=False)
        self.down_proj = _row_linear(plan.intermediate_size, config.hidden_size, False, parallel)
        self.act: nn.Module = GeluAndMul() if config.hidden_act == "gelu_pytorch_tanh" else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _mlp(config: ModelConfig, plan: ShardPlan, layer: int, parallel: ParallelContext) -> nn.Module:
    """Layer ``layer``'s MLP: the routed (and shared) experts of a mixture-of-experts layer, else a dense one."""
    if config.moe is None or not config.is_moe_layer(layer):
        return MLP(config, plan, parallel)
    start, count = plan.experts
    return SparseMoeBlock(config.hidden_size, config.moe, plan.moe_intermediate_size,
                          plan.shared_intermediate_size if config.moe.shared_intermediate_size else 0,
                          start, count, parallel)


def _attention(config: ModelConfig, plan: ShardPlan, rotary: RotaryEmbedding, parallel: ParallelContext,
               layer: int) -> nn.Module:
    if config.mla is not None:
        if config.window_of(layer) is not None:
            raise ValueError("sliding_window is not supported with multi-head latent attention")
        return MlaAttention(config.hidden_size, config.mla, plan.num_heads, config.rms_norm_eps, rotary, parallel)
    return Attention(config, plan, None if layer in config.nope_layers else rotary, parallel, config.window_of(layer))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, plan: ShardPlan, rotary: RotaryEmbedding, parallel: ParallelContext,
                 layer: int) -> None:
        """``layer``: the model's index of this layer (which decides a mixture-of-experts model's dense layers)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _attention(config, plan, rotary, parallel, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _mlp(config, plan, layer, parallel)
        self.residual_multiplier = config.residual_multiplier   # Granite's
        # Gemma 3's sandwich: the attention's and the MLP's outputs normalised before their residual adds
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (or the embeddings, with ``residual`` None). Returns this layer's
        MLP output and the residual stream (the sum of everything before it)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn = self.self_attn(h, positions, kv_cache, meta)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            h, residual = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(attn), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        if self.residual_multiplier != 1.0:
            attn = attn * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_and_norm(attn, residual)
        out = self.mlp(h)
        return (out * self.residual_multiplier if self.residual_multiplier != 1.0 else out), residual


# The layers that pick a kernel in ``use_kernels``.
KERNEL_LAYERS = (Linear, RMSNorm, SiluAndMul, GeluAndMul, RotaryEmbedding, FusedMoE)
