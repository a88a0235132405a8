"""The Llama block family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm).

Layout differs from transformers in two fused projections — q/k/v is one Linear and gate/up is one
Linear — so each layer runs three matmuls fewer; ``load_weights`` splices the checkpoint's separate
tensors into them. Sliding-window attention (Mistral v0.1, some Qwen2 configs) is ignored: every
layer attends over the full context, which is exact while sequences are shorter than the window.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.torch_backend import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.quant import QuantWeight, cat_rows
from engine.models.layers.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as transformers does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# Up to this many rows, a CPU float32 matmul runs faster as ``weight @ x.T`` than as ``x @ weight.T``:
# measured with torch 2.13's MKL on 2 AVX2 cores, 576 -> 3072 took 1.09 ms instead of 1.51 ms at 32 rows and
# the 576 -> 49152 lm_head 22 ms instead of 33 ms; from about 512 rows on the two are even.
SMALL_BATCH_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a 2-D batch, computed as ``(weight @ x.T).T`` for small CPU float32 batches."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 1 < x.shape[0] <= SMALL_BATCH_ROWS:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked (blocked) copy of a float32 or bfloat16 [out, in] CPU weight, for ``onednn_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# A linear with block-quantized weights (``Linear.quant``) runs the ``quant_linear`` kernel on them. In a
# float32 model, for steps of any size by default: up to 8 rows a fused kernel bound by reading the 5-bit
# codes, above a GEMM over weight panels expanded to float32 in cache: from even with oneDNN's float32 GEMM on
# the dequantized weights to 1.7x faster with weights hot in cache, 1.2-2.5x faster per model step
# (BENCHMARKS.md, "Quantized linears on every step"). The float32 copies of those weights are then freed.
# In a bfloat16 model (CPUs with AVX512-BF16 / AMX), only for steps of up to BF16_QUANT_MAX_ROWS rows, where
# reading a third of the bytes wins (the default model's 120 projections: 7.3 ms on the blocks against 10.9 ms
# on oneDNN at 1 row, 9.5 against 10.8 at 2, even at 3, 16.2 against 11.0 at 8, on 2 Sapphire Rapids-class
# cores); larger steps run oneDNN's bfloat16 GEMM (AMX). ``SLUICE_QUANT_MAX_ROWS=N`` sets the limit for both
# dtypes (0: never use the blocks; larger steps keep the dense weights, on oneDNN); read when this module is
# imported.
ENV_QUANT_MAX_ROWS = "SLUICE_QUANT_MAX_ROWS"
BF16_QUANT_MAX_ROWS = 2


def quant_max_rows_from_env() -> int | None:
    """``SLUICE_QUANT_MAX_ROWS`` as a row limit, None (no limit) when unset or empty."""
    text = os.environ.get(ENV_QUANT_MAX_ROWS, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_QUANT_MAX_ROWS} must be a non-negative integer, got {text!r}")
    return value


QUANT_MAX_ROWS = quant_max_rows_from_env()


def quant_max_rows(dtype: torch.dtype = torch.float32) -> int | None:
    """The most rows a step of a ``dtype`` model runs on the block-quantized weights (None: no limit)."""
    if QUANT_MAX_ROWS is not None:
        return QUANT_MAX_ROWS
    return None if dtype == torch.float32 else BF16_QUANT_MAX_ROWS


def uses_blocks(rows: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a step of ``rows`` rows runs on the block-quantized weights (where a layer has them)."""
    limit = quant_max_rows(dtype)
    return limit is None or rows <= limit


def quant_linear(ops: Any, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)`` by the float32 kernel; float32 out for any ``x`` dtype."""
    out = ops.quant_linear(x if x.dtype == torch.float32 else x.float(), weight.codes, weight.scales, weight.mins,
                           weight.format)
    return out if bias is None else out.add_(bias)


# A bfloat16 linear of a decode-sized step (at most AMX_LINEAR_MAX_ROWS rows) runs cpu_ops.amx_linear on its
# own tile-packed copy of the weight where the CPU has AMX: bound by reading the weights, it streams them
# 1.3-1.5x faster than oneDNN's GEMM does at these sizes (the default model's projections and lm_head: 11.8 ms
# against 17.5 ms per step at 32 rows; BENCHMARKS.md "Decode linears on AMX tiles"). Larger steps (prefill)
# run oneDNN, which blocks for the products that bound them.
# Such a layer drops its quantized blocks: a 1-sequence decode step took 13.4-14.0 ms on amx_linear against
# 14.4-16.0 ms on the blocks (2 sequences: 13.8-14.1 against 15.6-18.5), so BF16_QUANT_MAX_ROWS only
# applies where amx_linear does not run.
# The copy costs the weights' size again in memory: it is made only when it takes at most a quarter of the memory
# available at load (engine.kernels.AMX_LINEAR_MAX_MEMORY_SHARE); ``SLUICE_AMX_LINEAR=0`` does without it.
AMX_LINEAR_MAX_ROWS = 64


def amx_packable(weight: torch.Tensor | None) -> bool:
    """Whether ``cpu_ops.amx_pack_linear`` takes this [out, in] weight (bfloat16, both sides multiples of 32)."""
    return (weight is not None and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0)


class Linear(nn.Linear):
    """nn.Linear with four CPU paths: the small-batch one of ``linear``, oneDNN on a prepacked
    weight once ``pack_onednn`` ran (what vLLM's CPU backend and inductor's freezing use too),
    the ``quant_linear`` kernel on the checkpoint's block-quantized weight when it had one (``quant``,
    used once ``quant_ops`` is set, for the steps ``uses_blocks`` allows), and ``amx_linear`` on a
    tile-packed bfloat16 copy (``amx_packed``, once ``pack_amx`` ran) for steps of up to
    ``AMX_LINEAR_MAX_ROWS`` rows."""

    packed: torch.Tensor | None = None
    quant: QuantWeight | None = None
    quant_ops: Any = None
    model_dtype: torch.dtype = torch.float32  # set by CausalLM.use_cpu_ops: picks the row limit of the blocks
    amx_packed: torch.Tensor | None = None
    amx_ops: Any = None

    def pack_amx(self, ops: Any) -> bool:
        """Keep a copy of the bfloat16 weight in ``amx_linear``'s tile layout; False when it does not fit one.
        The block-quantized copy, if any, is dropped: from 1 row on ``amx_linear`` is the faster of the two."""
        weight = self.dense_weight() if self.weight is not None or self.packed is not None else None
        if not amx_packable(weight):
            return False
        self.amx_packed = ops.amx_pack_linear(weight)
        self.amx_ops = ops
        self.quant = None
        self.quant_ops = None
        return True

    def pack_onednn(self) -> None:
        """Swap the weight for oneDNN's prepacked copy; the plain weight is freed (``weight`` is None)."""
        self.packed = onednn_pack(self.weight)
        self.weight = None  # type: ignore[assignment]

    @property
    def blocks_only(self) -> bool:
        """True when every step runs on the blocks, so the dense weight is never read."""
        return self.quant_ops is not None and quant_max_rows(self.model_dtype) is None

    def free_dense(self) -> None:
        """Drops the float32 weight (plain or packed) of a ``blocks_only`` layer."""
        if not self.blocks_only:
            raise RuntimeError("free_dense: this layer still reads its float32 weight")
        self.packed = None
        self.weight = None  # type: ignore[assignment]

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight, unpacked when it is held by oneDNN."""
        return self.weight if self.packed is None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_ops is not None:
            rows = x.reshape(-1, x.shape[-1])
            if uses_blocks(rows.shape[0], self.model_dtype):
                out = quant_linear(self.quant_ops, rows, self.quant, self.bias)  # type: ignore[arg-type]
                out = out if out.dtype == x.dtype else out.to(x.dtype)
                return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
        if self.amx_packed is not None and x.dtype == torch.bfloat16:
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] <= AMX_LINEAR_MAX_ROWS:
                if rows.stride(-1) != 1:  # the kernel reads whole rows
                    rows = rows.contiguous()
                out = self.amx_ops.amx_linear(rows, self.amx_packed, self.bias)
                return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
        if self.packed is not None:
            return onednn_linear(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """A lookup table with no initialiser: nn.Embedding's normal_() on the meta device pulls in
    torch's Python decompositions, seconds of import time at every model load."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary  # one module shared by every layer; its buffers are not persistent
        self.scale = config.head_dim ** -0.5
        self.ops: Any = None  # engine.kernels.cpu_ops once CausalLM.use_cpu_ops ran

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.ops is not None:  # in place on the fused projection's output
            self.ops.rotary_(q, positions, self.rotary.cos_cache, self.rotary.sin_cache)
            self.ops.rotary_(k, positions, self.rotary.cos_cache, self.rotary.sin_cache)
        else:
            q, k = self.rotary(positions, q, k)
        out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.ops: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata, ops: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the residual stream carried separately (vLLM's layout): each residual add
        is fused into the RMSNorm that follows it. ``x`` is the previous layer's MLP output (or the
        embeddings, with ``residual`` None); returns this layer's MLP output and the residual."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual = x
            h = ops.rms_norm(x, norm1.weight, norm1.eps)
        else:
            h = ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)  # residual += x
        h = ops.add_rms_norm(self.self_attn(h, positions, kv_cache, meta), residual, norm2.weight, norm2.eps)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Decoder-only language model over a flat batch of tokens (no padding) and a paged KV cache."""

    # Set by the CPU device after loading (engine.kernels.prepare_cpu_model): pack_onednn, use_cpu_ops.
    onednn_packed = False
    _tied_packed: torch.Tensor | None = None  # oneDNN copy of the tied embedding, for the lm_head
    _tied_quant: QuantWeight | None = None  # the tied embedding's block-quantized form, for the lm_head
    _tied_amx: torch.Tensor | None = None  # the tied embedding in amx_linear's tile layout, for the lm_head
    _ops: Any = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: int64 [T]; one KV cache per layer. Returns the final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        ops = self._ops
        if ops is not None:
            residual: torch.Tensor | None = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer.forward_fused(x, residual, positions, kv_cache, meta, ops)
            assert residual is not None
            return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in ``dtype``; ``None``: as the lm_head computes them (the model's
        dtype, float32 on the quantized blocks). The engine passes None: its sampler widens what it must, and
        greedy rows take the argmax of bfloat16 logits as they are (the same answer, no float32 copy)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self._tied_quant is not None and self._ops is not None and uses_blocks(hidden.shape[0], hidden.dtype):
            logits = quant_linear(self._ops, hidden, self._tied_quant)
        elif self._tied_amx is not None and hidden.dtype == torch.bfloat16 and hidden.shape[0] <= AMX_LINEAR_MAX_ROWS:
            logits = self._ops.amx_linear(hidden, self._tied_amx)
        elif self._tied_packed is not None:
            logits = onednn_linear(hidden, self._tied_packed)
        else:
            logits = linear(hidden, self.embed_tokens.weight)
        return logits if dtype is None else logits.to(dtype)

    def _require_kernel_dtype(self, what: str) -> torch.dtype:
        """The model's dtype, when it is a CPU float32 or bfloat16 model (what the CPU kernels take)."""
        dtypes = {p.dtype for p in self.parameters()}
        if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16} or any(
                p.device.type != "cpu" for p in self.parameters()):
            raise ValueError(f"{what}: float32 or bfloat16 CPU models only")
        return dtypes.pop()

    @property
    def uses_cpu_ops(self) -> bool:
        return self._ops is not None

    def use_cpu_ops(self, ops: Any) -> None:
        """Run RMSNorm (fused with the residual adds), SiLU-and-mul and rotary through ``ops``
        (engine.kernels.cpu_ops: float32 / bfloat16 CPU kernels), each one pass over memory instead of several.

        Projections with block-quantized weights run ``quant_linear`` from then on for the steps
        ``uses_blocks`` allows (every step of a float32 model by default: their float32 weights are then
        freed; small steps of a bfloat16 model, widened to float32 for the kernel)."""
        dtype = self._require_kernel_dtype("use_cpu_ops")
        self._ops = ops
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.ops = ops
            elif isinstance(module, Linear) and module.quant is not None:
                module.quant_ops = ops
                module.model_dtype = dtype
                if module.blocks_only:
                    module.free_dense()
        if self._tied_quant is not None and quant_max_rows(dtype) is None:
            self._tied_packed = None  # the embedding table itself stays: token lookup reads it

    @property
    def quantized_linears(self) -> int:
        """How many projections (and a tied lm_head) hold a block-quantized weight."""
        count = sum(1 for m in self.modules() if isinstance(m, Linear) and m.quant is not None)
        return count + (self._tied_quant is not None)

    def load_quantized(self, weights: Iterable[tuple[str, QuantWeight]]) -> int:
        """Keeps block-quantized copies of projection weights (named as in ``load_weights``, which must
        have loaded the same values dequantized) for the ``quant_linear`` path. A fused
        projection gets one only when all its shards come quantized in one format. Returns how many
        projections got one."""
        shards: dict[str, dict[int, QuantWeight]] = {}
        for hf_name, weight in weights:
            target = _map_name(hf_name, self.config)
            if target is None or not target[0].endswith(".weight"):
                continue
            shards.setdefault(target[0], {})[target[1]] = weight
        count = 0
        for name, parts in shards.items():
            if len(parts) != _num_shards(name):
                continue
            fused = cat_rows([parts[i] for i in range(len(parts))])
            if name == "embed_tokens.weight":
                if self.lm_head is None and fused is not None and fused.shape == tuple(self.embed_tokens.weight.shape):
                    self._tied_quant = fused
                    count += 1
                continue
            module = self.get_submodule(name.removesuffix(".weight"))
            if fused is None or not isinstance(module, Linear) or fused.shape != (module.out_features, module.in_features):
                continue
            module.quant = fused
            count += 1
        return count

    def drop_quantized(self) -> None:
        """Frees the block-quantized copies (when the kernel that reads them is unavailable)."""
        if any(isinstance(m, Linear) and m.weight is None and m.packed is None for m in self.modules()):
            raise RuntimeError("drop_quantized: some layers have only their blocks left (float32 freed)")
        self._tied_quant = None
        for module in self.modules():
            if isinstance(module, Linear):
                module.quant = None
                module.quant_ops = None

    def pack_onednn(self) -> None:
        """Prepack every projection and the lm_head for oneDNN (CPU, float32 or bfloat16; after ``load_weights``).

        From 1.1x (576 -> 3072 at 128 rows) to 2x (the 576 -> 49152 lm_head at 32 rows) faster than
        ``F.linear`` with torch 2.13 on 2 AVX2 cores. A tied lm_head gets its own packed copy: the
        embedding lookup still needs the plain table.
        """
        dtype = self._require_kernel_dtype("pack_onednn")
        for module in self.modules():
            if isinstance(module, Linear) and module.weight is not None:  # None: freed, runs on its blocks
                module.pack_onednn()
        if self.lm_head is None and not (self._tied_quant is not None and self._ops is not None
                                         and quant_max_rows(dtype) is None):
            self._tied_packed = onednn_pack(self.embed_tokens.weight)
        self.onednn_packed = True

    def amx_pack_bytes(self) -> int:
        """How much memory ``pack_amx`` would add: the tile-packed copies of the weights it can pack."""
        sizes = [m.out_features * m.in_features for m in self.modules()
                 if isinstance(m, Linear) and m.out_features % 32 == 0 and m.in_features % 32 == 0
                 and (m.weight is not None or m.packed is not None)]
        if self.lm_head is None and amx_packable(self.embed_tokens.weight):
            sizes.append(self.embed_tokens.weight.numel())
        return 2 * sum(sizes)

    def pack_amx(self, ops: Any) -> int:
        """Give every bfloat16 projection (and a tied lm_head) a copy in ``amx_linear``'s tile layout, for
        steps of up to ``AMX_LINEAR_MAX_ROWS`` rows (after ``use_cpu_ops``: the lm_head runs through its ops),
        in place of their block-quantized copies. Returns how many got one; those whose sides are not
        multiples of 32 keep oneDNN (and their blocks for the smallest steps)."""
        if self._require_kernel_dtype("pack_amx") != torch.bfloat16:
            raise ValueError("pack_amx: bfloat16 models only")
        count = sum(module.pack_amx(ops) for module in self.modules() if isinstance(module, Linear))
        if self.lm_head is None and self._ops is not None and amx_packable(self.embed_tokens.weight):
            self._tied_amx = ops.amx_pack_linear(self.embed_tokens.weight)
            self._tied_quant = None
            count += 1
        return count

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies tensors named as in a Hugging Face checkpoint into this model's fused layout.

        Raises if a parameter is left unloaded or a name is unknown.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()  # (parameter, shard index)
        for hf_name, tensor in weights:
            target = _map_name(hf_name, self.config)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model ({name!r})")
            dest = _shard_view(params[name], name, shard, self.config)
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add((name, shard))
        missing = [n for n in params if not all((n, s) in loaded for s in range(_num_shards(n)))]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _map_name(hf_name: str, config: ModelConfig) -> tuple[str, int] | None:
    """HF checkpoint name -> (our parameter name, shard index within a fused parameter), or None to skip."""
    name = hf_name.removeprefix("model.")
    if name.startswith("rotary_emb.") or ".rotary_emb." in name:
        return None  # some old checkpoints store inv_freq; ours is recomputed
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # tied checkpoints sometimes still carry a copy
    for part, shard in _QKV.items():
        if f".self_attn.{part}." in name:
            return name.replace(part, "qkv_proj"), shard
    for part, shard in _GATE_UP.items():
        if f".mlp.{part}." in name:
            return name.replace(part, "gate_up_proj"), shard
    return name, 0


def _num_shards(param_name: str) -> int:
    if ".qkv_proj." in param_name:
        return 3
    if ".gate_up_proj." in param_name:
        return 2
    return 1


def _shard_view(param: torch.Tensor, name: str, shard: int, config: ModelConfig) -> torch.Tensor:
    if ".qkv_proj." in name:
        sizes = [config.q_size, config.kv_size, config.kv_size]
    elif ".gate_up_proj." in name:
        sizes = [config.intermediate_size, config.intermediate_size]
    else:
        return param
    start = sum(sizes[:shard])
    return param.narrow(0, start, sizes[shard])


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """An uninitialised model on ``device`` (weights are garbage until ``load_weights``)."""
    with torch.device("meta"):
        model = CausalLM(config)
    # Materialising from meta skips random initialisation, which would cost seconds for nothing.
    model = model.to(dtype=dtype).to_empty(device=device)
    model.rotary.build_cache(device, dtype)
    return model.eval().requires_grad_(False)
