"""BERT-family encoders for the pooling runner: BERT (``BertModel``, ``BertForSequenceClassification``) and
(XLM-)RoBERTa (bge-m3's ``XLMRobertaModel``, bge-reranker's ``XLMRobertaForSequenceClassification``).

Post-LayerNorm transformer blocks with bidirectional attention over each sequence of a flat batch (no padding, no
KV cache: every request is one forward over its whole prompt). RoBERTa numbers positions from ``padding_idx + 1``
as transformers' ``create_position_ids_from_input_ids`` does for an unpadded input; BERT from 0. A classifier's
head is BERT's (pooler dense + tanh on the CLS state, then ``classifier``) or RoBERTa's (``classifier.dense`` +
tanh, then ``classifier.out_proj``).
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

# Checkpoint name prefixes of the encoder inside a task model.
_PREFIXES = ("bert.", "roberta.", "model.")


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int      # RoBERTa: padding_idx + 1; BERT: 0
    num_labels: int = 0       # > 0: a sequence classifier's head is loaded

    @property
    def max_len(self) -> int:
        """Longest input: the position table's rows past the offset."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], num_labels: int = 0) -> EncoderConfig:
        model_type = str(cfg["model_type"])
        act = str(cfg.get("hidden_act", "gelu"))
        if act not in _ACTS:
            raise ValueError(f"hidden_act {act!r} is not supported for {model_type}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported")
        roberta = model_type in ("roberta", "xlm-roberta")
        return cls(model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                   num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
                   intermediate_size=int(cfg["intermediate_size"]),
                   max_position_embeddings=int(cfg["max_position_embeddings"]),
                   type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), hidden_act=act,
                   position_offset=int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0, num_labels=num_labels)


class _SelfAttention(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = EncoderLinear(config.hidden_size, 3 * config.hidden_size)
        self.out = EncoderLinear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        ctx = layout.attend(q, k, v).reshape(x.shape[0], -1)   # bidirectional within each sequence
        return self.norm(self.out(ctx, residual=x))


class _Layer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = _SelfAttention(config)
        self.intermediate = EncoderLinear(config.hidden_size, config.intermediate_size)
        self.output = EncoderLinear(config.intermediate_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
        x = self.attention(x, layout)
        return self.norm(self.output(self.intermediate(x, act=self.act), residual=x))


class BertEncoder(nn.Module):
    """Embeddings + encoder layers (+ a classifier head when ``config.num_labels``) over a flat batch."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.head_dense: nn.Linear | None = None
        self.head_out: nn.Linear | None = None
        if config.num_labels:
            self.head_dense = nn.Linear(h, h)
            self.head_out = nn.Linear(h, config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        """input_ids, positions (0-based within each sequence), token_type_ids: int64 [T]. Returns [T, hidden]."""
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.config.position_offset)
             + self.token_type_embeddings(token_type_ids))
        x = self.embed_norm(x)
        layout = VarlenLayout(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def use_kernels(self, choice: KernelChoice) -> None:
        """The encoder layers' linears run on oneDNN's prepacked weights when the device offers them (the CPU);
        the classifier head (a few rows per step) stays on ``F.linear``."""
        if choice.onednn:
            pack_linears(self.layers)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] CLS states -> [N, num_labels] logits (BERT: the pooler's dense + tanh, then the classifier;
        RoBERTa: its classification head's dense + tanh, then out_proj)."""
        assert self.head_dense is not None and self.head_out is not None
        return self.head_out(torch.tanh(self.head_dense(cls_states)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors named as transformers saves them; raises naming what is missing or has no place."""
        params = dict(self.named_parameters())
        qkv: dict[int, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = _our_name(hf_name, self.config.num_labels > 0)
            if name is None:
                continue
            if name.startswith("qkv:"):
                _, layer, part = name.split(":")
                qkv.setdefault(int(layer), {})[part] = tensor
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this encoder ({name!r})")
            _copy(params[name], tensor, hf_name)
            loaded.add(name)
        for index, parts in qkv.items():
            for kind in ("weight", "bias"):
                pieces = [parts[f"{p}.{kind}"] for p in ("query", "key", "value") if f"{p}.{kind}" in parts]
                if len(pieces) == 3:   # fused as q, k, v rows
                    fused = f"layers.{index}.attention.qkv.{kind}"
                    _copy(params[fused], torch.cat(pieces), fused)
                    loaded.add(fused)
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)


_FIXED = {"embeddings.word_embeddings": "word_embeddings", "embeddings.position_embeddings": "position_embeddings",
          "embeddings.token_type_embeddings": "token_type_embeddings", "embeddings.LayerNorm": "embed_norm"}
_LAYER = {"attention.output.dense": "attention.out", "attention.output.LayerNorm": "attention.norm",
          "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "norm"}
# Classifier heads: BERT's pooler + classifier, RoBERTa's classification head.
_HEAD = {"pooler.dense": "head_dense", "classifier.dense": "head_dense", "classifier.out_proj": "head_out",
         "classifier": "head_out"}


def _our_name(hf_name: str, with_head: bool) -> str | None:
    """Our parameter's name for a checkpoint tensor; ``qkv:<layer>:<query|key|value>.<kind>`` for the parts of the
    fused q/k/v; None for tensors not used (position_ids buffers, an embedder's pooler, an MLM head)."""
    name = hf_name
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    module, _, kind = name.rpartition(".")
    if module in _FIXED:
        return f"{_FIXED[module]}.{kind}"
    if module in _HEAD:
        return f"{_HEAD[module]}.{kind}" if with_head else None
    if module.startswith("encoder.layer."):
        rest = module.removeprefix("encoder.layer.")
        index, _, sub = rest.partition(".")
        if sub.startswith("attention.self."):
            return f"qkv:{index}:{sub.removeprefix('attention.self.')}.{kind}"
        if sub in _LAYER:
            return f"layers.{index}.{_LAYER[sub]}.{kind}"
    if kind == "position_ids" or module.startswith(("cls.", "lm_head")):
        return None
    raise ValueError(f"checkpoint tensor {hf_name!r} is not part of a BERT / XLM-RoBERTa encoder")
