"""The Llama block family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm).

Layout differs from transformers in two fused projections — q/k/v is one Linear and gate/up is one
Linear — so each layer runs three matmuls fewer; ``load_weights`` splices the checkpoint's separate
tensors into them. The residual stream is carried beside the hidden states (vLLM's layout) so that each
residual add is fused into the RMSNorm after it. Sliding-window attention (Mistral v0.1, some Qwen2 configs)
is ignored: every layer attends over the full context, which is exact while sequences are shorter than the
window. The layers pick their kernels once, in ``use_kernels``; the forward pass does not branch on them.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.device.kernel_choice import KernelChoice
from engine.models.config import ModelConfig
from engine.models.layers.activation import SiluAndMul
from engine.models.layers.embedding import Embedding
from engine.models.layers.linear import Linear
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import RotaryEmbedding
from engine.models.quant import QuantWeight, cat_rows


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, on_heads=True) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, on_heads=True) if config.qk_norm else None
        self.rotary = rotary  # one module shared by every layer; its buffers are not persistent
        self.scale = config.head_dim ** -0.5

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
        q, k = self.rotary(positions, q, k)
        out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output (or the embeddings, with ``residual`` None). Returns this layer's
        MLP output and the residual stream (the sum of everything before it)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(h, positions, kv_cache, meta),
                                                                 residual)
        return self.mlp(h), residual


# The layers that pick a kernel in ``use_kernels``.
KERNEL_LAYERS = (Linear, RMSNorm, SiluAndMul, RotaryEmbedding)


class CausalLM(nn.Module):
    """Decoder-only language model over a flat batch of tokens (no padding) and a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A tied lm_head shares the embedding table (``tie_weights``): its methods never free it.
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.is_lm_head = True
        self.lm_head.shares_weight = config.tie_word_embeddings

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: int64 [T]; one KV cache per layer. Returns the final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_cache, meta)
        assert residual is not None
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in ``dtype``; ``None``: as the lm_head computes them (the model's
        dtype, float32 on the quantized blocks). The engine passes None: its sampler widens what it must, and
        greedy rows take the argmax of bfloat16 logits as they are (the same answer, no float32 copy)."""
        logits = self.lm_head(hidden)
        return logits if dtype is None else logits.to(dtype)

    def use_kernels(self, choice: KernelChoice) -> None:
        """Every layer picks its kernel from ``choice``, once, after the weights are loaded (the device decides
        the choice: ``Device.kernel_choice``)."""
        for module in self.modules():
            if isinstance(module, KERNEL_LAYERS):
                module.use_kernels(choice)

    def amx_pack_bytes(self) -> int:
        """How much memory tile-packed copies of every linear's weight would add (``KernelChoice.amx_linear``)."""
        return sum(m.amx_pack_bytes() for m in self.modules() if isinstance(m, Linear))

    @property
    def quantized_linears(self) -> int:
        """How many projections (and the lm_head) hold GGUF blocks."""
        return sum(1 for m in self.modules() if isinstance(m, Linear) and m.holds_blocks)

    def load_quantized(self, weights: Iterable[tuple[str, QuantWeight]]) -> int:
        """Keeps block-quantized copies of projection weights (named as in ``load_weights``, which must
        have loaded the same values dequantized), for ``use_kernels`` to run them. A fused projection gets
        one only when all its shards come quantized in one format. Returns how many projections got one."""
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
            module: nn.Module | None
            if name == "embed_tokens.weight":  # the tied lm_head computes on the table's blocks
                module = self.lm_head if self.config.tie_word_embeddings else None
            else:
                module = self.get_submodule(name.removesuffix(".weight"))
            if fused is None or not isinstance(module, Linear) or fused.shape != (module.out_features,
                                                                                    module.in_features):
                continue
            module.quant = fused
            count += 1
        return count

    def drop_quantized(self) -> None:
        """Forgets the blocks ``load_quantized`` kept (before ``use_kernels``): every layer stays dense."""
        for module in self.modules():
            if isinstance(module, Linear):
                if module.weight is None:
                    raise RuntimeError("drop_quantized: some layers have only their blocks left (float32 freed)")
                module.quant = None

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
    model.tie_weights()
    model.rotary.build_cache(device, dtype)
    return model.eval().requires_grad_(False)
