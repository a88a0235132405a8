"""ModernBERT (``ModernBertModel``, ``ModernBertForSequenceClassification``) for the pooling runner.

Pre-LayerNorm blocks (the first without its attention norm), fused q/k/v, rotary positions whose base differs
between global layers and local ones, bidirectional attention within each sequence — a local layer over the tokens
at most ``local_attention // 2`` positions away, as transformers' sliding-window mask — and a GeGLU MLP. Module
names are transformers', so the checkpoint loads by name.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.device.kernel_choice import KernelChoice
from engine.models.encoder_linear import ACTS as _ACTS
from engine.models.encoder_linear import EncoderLinear, pack_linears
from engine.models.varlen_attention import VarlenLayout


@dataclass(frozen=True)
class ModernBertConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    layer_types: tuple[str, ...]     # "full_attention" | "sliding_attention" per layer
    global_theta: float
    local_theta: float
    window: int                      # a local layer's reach either side (local_attention // 2)
    num_labels: int = 0
    classifier_pooling: str = "cls"
    classifier_bias: bool = False
    classifier_act: str = "gelu"

    type_vocab_size = None           # ModernBERT reads no segment ids

    @property
    def max_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_labels: int = 0) -> ModernBertConfig:
        n = int(cfg["num_hidden_layers"])
        every = int(cfg.get("global_attn_every_n_layers", 3))
        types = cfg.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(n)]
        rope = cfg.get("rope_parameters") or {}
        for kind in ("full_attention", "sliding_attention"):
            if (rope.get(kind) or {}).get("rope_type", "default") != "default":
                raise ValueError(f"ModernBERT rope_type {rope[kind]['rope_type']!r} is not supported")
        act = str(cfg.get("hidden_activation", "gelu"))
        head_act = str(cfg.get("classifier_activation", "gelu"))
        if act not in _ACTS or head_act not in _ACTS:
            raise ValueError(f"ModernBERT activation {act!r} / {head_act!r} is not supported")
        return cls(model_type="modernbert", vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                   num_layers=n, num_heads=int(cfg["num_attention_heads"]),
                   intermediate_size=int(cfg["intermediate_size"]),
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                   layer_norm_eps=float(cfg.get("norm_eps", 1e-5)), norm_bias=bool(cfg.get("norm_bias", False)),
                   attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
                   hidden_act=act, layer_types=tuple(types),
                   global_theta=float((rope.get("full_attention") or {}).get(
                       "rope_theta", cfg.get("global_rope_theta", 160000.0))),
                   local_theta=float((rope.get("sliding_attention") or {}).get(
                       "rope_theta", cfg.get("local_rope_theta", 10000.0))),
                   window=int(cfg.get("local_attention", 128)) // 2, num_labels=num_labels,
                   classifier_pooling=str(cfg.get("classifier_pooling", "cls")),
                   classifier_bias=bool(cfg.get("classifier_bias", False)), classifier_act=head_act)


class _Embeddings(nn.Module):
    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)


class _Attention(nn.Module):
    def __init__(self, config: ModernBertConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.Wqkv = EncoderLinear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = EncoderLinear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.local = config.layer_types[layer] == "sliding_attention"
        self.theta = config.local_theta if self.local else config.global_theta
        self.window = config.window

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layout: VarlenLayout,
                residual: torch.Tensor) -> torch.Tensor:
        """``residual`` + attention over ``x`` (the normed states)."""
        q, k, v = self.Wqkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        dims = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=x.device) / self.head_dim
        freqs = positions[:, None].float() * (1.0 / self.theta ** dims)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = layout.attend(q, k, v, window=self.window if self.local else None)
        return self.Wo(out.reshape(x.shape[0], -1), residual=residual)


class _Mlp(nn.Module):
    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = EncoderLinear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.Wo = EncoderLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = _ACTS[config.hidden_act]

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` + the GeGLU MLP of ``x`` (the normed states)."""
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inp) * gate, residual=residual)


class _Layer(nn.Module):
    def __init__(self, config: ModernBertConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm: nn.Module = (nn.Identity() if layer == 0 else
                                     nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                                  bias=config.norm_bias))
        self.attn = _Attention(config, layer)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.mlp = _Mlp(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
        x = self.attn(self.attn_norm(x), positions, layout, residual=x)
        return self.mlp(self.mlp_norm(x), residual=x)


class _Head(nn.Module):
    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.act = _ACTS[config.classifier_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertEncoder(nn.Module):
    """The encoder (+ the classification head and classifier when ``config.num_labels``) over a flat batch."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.head: _Head | None = None
        self.classifier: nn.Linear | None = None
        if config.num_labels:
            self.head = _Head(config)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        """[T, hidden] (``token_type_ids`` are not read)."""
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        layout = VarlenLayout(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, positions, layout)
        return self.final_norm(x)

    def use_kernels(self, choice: KernelChoice) -> None:
        """The layers' linears run on oneDNN's prepacked weights when the device offers them (the CPU); the head
        (a few rows per step) stays on ``F.linear``."""
        if choice.onednn:
            pack_linears(self.layers)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled states (CLS or mean, per ``classifier_pooling``) -> [N, num_labels] logits."""
        assert self.head is not None and self.classifier is not None
        return self.classifier(self.head(pooled))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors named as transformers saves them; raises naming what is missing or has no place."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.startswith(("decoder.", "head.")) and self.head is None:
                continue   # a masked-LM head, unused by an embedder
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this ModernBERT encoder")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected "
                                 f"{tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
