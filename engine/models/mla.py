"""DeepSeek's multi-head latent attention (MLA), over the latent cache of :mod:`engine.attention.mla`.

Per token the layer computes the queries of its heads (``q_proj``, or ``q_a_proj`` -> RMSNorm -> ``q_b_proj`` with
q LoRA), each ``qk_nope_head_dim + qk_rope_head_dim`` wide, and one shared latent ``kv_a_proj_with_mqa(x)`` =
``[c_kv | k_pe]``: ``c_kv`` normalised (``kv_a_layernorm``) and ``k_pe`` rotated is what the cache keeps. Keys and
values of head h are ``kv_b_proj``'s rows of that head applied to ``c_kv``: ``k_nope = W_UK[h] c_kv``,
``v = W_UV[h] c_kv``, the key being ``[k_nope | k_pe]``.

* Decode rows absorb the up-projections (DeepSeek's inference code, vLLM's MLA backends): the query becomes
  ``[W_UK[h]^T q_nope | q_pe]``, attention runs against the cached latents themselves, and the output
  ``W_UV[h] o_latent``. Nothing per head is ever expanded over the context.
* Prefill chunks expand the sequence's cached latents through ``kv_b_proj`` and attend per head.

Rotary: DeepSeek rotates adjacent pairs of dimensions (``rope_interleave``, always in V2); the pairs are taken apart
into halves first (evens, then odds) for queries and keys alike, which leaves every dot product as transformers
computes it, and the shared ``RotaryEmbedding`` then rotates halves. Under tensor parallelism a rank holds its heads'
rows of ``q_proj`` / ``q_b_proj`` / ``kv_b_proj`` and columns of ``o_proj``; the latent projections are replicated
and so is the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.attention.mla import prefill_attention
from engine.distributed import ParallelContext
from engine.models.layers.linear import Linear, RowParallelLinear
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding
from engine.models.moe_config import MlaConfig


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: [heads * (qk_nope + v), kv_lora_rank], read whole by both the absorbed decode and the expanded
    prefill, so it stays a plain weight (no linear method frees or repacks it)."""

    def __init__(self, kv_lora_rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank), requires_grad=False)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Adjacent rotary pairs (x0, x1), (x2, x3), ... laid out as halves (x0, x2, ... | x1, x3, ...), contiguous."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MlaAttention(nn.Module):
    def __init__(self, hidden_size: int, mla: MlaConfig, num_heads: int, rms_norm_eps: float,
                 rotary: RotaryEmbedding, parallel: ParallelContext) -> None:
        """``num_heads``: this rank's."""
        super().__init__()
        self.mla = mla
        self.num_heads = num_heads
        q_out = num_heads * mla.qk_head_dim
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, rms_norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, mla.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = LatentUpProjection(mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        o_in = num_heads * mla.v_head_dim
        self.o_proj = (RowParallelLinear(o_in, hidden_size, False, parallel) if parallel.tp_size > 1
                       else Linear(o_in, hidden_size, bias=False))
        self.rotary = rotary

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, qk_nope, L] and W_UV [H, v, L]: views of ``kv_b_proj``."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        m = self.mla
        num_tokens, heads = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        else:
            q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        latent_ops = meta.backend.latent_attention()
        latent_ops.write(torch.cat((c_kv, k_pe.squeeze(1)), dim=-1), kv_cache, meta)

        w_uk, w_uv = self._up_weights()
        outputs: list[torch.Tensor] = []
        n = meta.num_decodes
        if n > 0:
            q_latent = torch.bmm(q_nope[:n].transpose(0, 1), w_uk.to(x.dtype)).transpose(0, 1)   # [N, H, L]
            o_latent = latent_ops.decode(torch.cat((q_latent, q_pe[:n]), dim=-1), kv_cache, meta, m.kv_lora_rank,
                                         m.softmax_scale)
            outputs.append(torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2).to(x.dtype)).transpose(0, 1))
        start = n
        for i in range(n, meta.num_seqs):
            end = start + meta.query_lens[i]
            latents = latent_ops.sequence_latents(kv_cache, meta, i).to(x.dtype)
            kv = F.linear(latents[:, :m.kv_lora_rank], self.kv_b_proj.weight.to(x.dtype))
            kv = kv.view(-1, heads, m.qk_nope_head_dim + m.v_head_dim)
            k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            k_rot = latents[:, None, m.kv_lora_rank:].expand(-1, heads, m.qk_rope_head_dim)
            keys = torch.cat((k_nope, k_rot), dim=-1)
            query = torch.cat((q_nope[start:end], q_pe[start:end]), dim=-1)
            outputs.append(prefill_attention(query, keys, v, m.softmax_scale))
            start = end
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        return self.o_proj(out.reshape(num_tokens, heads * m.v_head_dim))
