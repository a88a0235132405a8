"""CLIP's vision transformer (transformers' ``CLIPVisionModel``), as LLaVA-style models use it: the image's patches
and a CLS position through pre-LayerNorm encoder layers, the hidden states of one chosen layer handed on.

Only the layers up to the one a model reads its features from are built and run (LLaVA-1.5 reads the one before
the last, ``vision_feature_layer=-2``), as vLLM does: the last layer's output would be thrown away.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class ClipVisionConfig:
    """The sizes of a CLIP vision tower, from a ``vision_config`` (``model_type: clip_vision_model``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ClipVisionConfig:
        kind = cfg.get("model_type", "clip_vision_model")
        if kind != "clip_vision_model":
            raise ValueError(f"vision tower {kind!r} is not supported (clip_vision_model)")
        act = str(cfg.get("hidden_act", "quick_gelu"))
        if act not in _ACTIVATIONS:
            raise ValueError(f"clip_vision_model: hidden_act={act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        return cls(hidden_size=int(cfg.get("hidden_size", 768)), intermediate_size=int(cfg.get("intermediate_size",
                                                                                                3072)),
                   num_layers=int(cfg.get("num_hidden_layers", 12)), num_heads=int(cfg.get("num_attention_heads", 12)),
                   image_size=int(cfg.get("image_size", 224)), patch_size=int(cfg.get("patch_size", 32)),
                   num_channels=int(cfg.get("num_channels", 3)), layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
                   hidden_act=act)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ClipAttention(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, width = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                   self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)   # every position sees every other (no mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, width))


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(config.num_patches + 1, config.hidden_size)
        self.image_size = config.image_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values of {tuple(pixel_values.shape[-2:])} pixels; this vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipEncoder(nn.Module):
    def __init__(self, config: ClipVisionConfig, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class ClipVisionTower(nn.Module):
    """[images, channels, H, W] pixel values -> the hidden states of encoder layer ``feature_layer`` (transformers'
    ``hidden_states[feature_layer]``: 0 is the embeddings after the pre-LayerNorm, -1 the last layer's output),
    [images, 1 + patches, hidden]. Parameters are named as in the checkpoint's vision tower (``embeddings.*``,
    ``pre_layrnorm.*``, ``encoder.layers.N.*``); the layers past ``feature_layer`` and the post-LayerNorm are not
    built."""

    def __init__(self, config: ClipVisionConfig, feature_layer: int) -> None:
        super().__init__()
        self.config = config
        depth = feature_layer if feature_layer >= 0 else config.num_layers + 1 + feature_layer
        if not 0 <= depth <= config.num_layers:
            raise ValueError(f"vision_feature_layer={feature_layer} is outside the tower's "
                             f"{config.num_layers} layers")
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = ClipEncoder(config, depth)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))
