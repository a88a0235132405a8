"""Qwen2-VL's vision transformer (transformers' ``Qwen2VisionTransformerPretrainedModel``): patches of
``temporal_patch_size`` frames x ``patch_size`` x ``patch_size`` pixels embedded by a Conv3d (as one matmul), blocks
of full attention over one image's patches with a 2-D rotary embedding (the first half of each head's frequencies
rotate by the patch's row, the second half by its column), and the PatchMerger: each ``spatial_merge_size`` x
``spatial_merge_size`` group of neighbouring patches (adjacent in the processor's patch order) normed, concatenated
and projected by a two-layer MLP to the language model's width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")


@dataclass(frozen=True)
class Qwen2VisionConfig:
    depth: int
    embed_dim: int
    hidden_size: int          # the language model's width, the merger's output
    num_heads: int
    mlp_ratio: float
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int = 3
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch in ``pixel_values``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen2VisionConfig:
        act = cfg.get("hidden_act", "quick_gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"qwen2_vl: vision hidden_act={act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        rope = cfg.get("rope_parameters") or {}
        return cls(depth=int(cfg.get("depth", 32)), embed_dim=int(cfg.get("embed_dim", 1280)),
                   hidden_size=int(cfg.get("hidden_size", 3584)), num_heads=int(cfg.get("num_heads", 16)),
                   mlp_ratio=float(cfg.get("mlp_ratio", 4)), patch_size=int(cfg.get("patch_size", 14)),
                   temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
                   spatial_merge_size=int(cfg.get("spatial_merge_size", 2)),
                   in_channels=int(cfg.get("in_channels", cfg.get("in_chans", 3))),
                   hidden_act=act, rope_theta=float(rope.get("rope_theta", 10000.0)))


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, config: Qwen2VisionConfig) -> None:
        super().__init__()
        dim = config.embed_dim
        self.num_heads = config.num_heads
        self.act = config.hidden_act
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, int(dim * config.mlp_ratio))
        self.fc2 = nn.Linear(int(dim * config.mlp_ratio), dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [P, dim], one image's patches; cos / sin [P, 1, head_dim] (float32)."""
        n = len(x)
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, -1).unbind(1)
        # rotated in float32, as transformers' apply_rotary_pos_emb_vision
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.proj(attn.transpose(0, 1).reshape(n, -1))
        return x + self.fc2(_act(self.act, self.fc1(self.norm2(x))))


class PatchMerger(nn.Module):
    def __init__(self, config: Qwen2VisionConfig) -> None:
        super().__init__()
        width = config.embed_dim * config.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, config.hidden_size)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.width))))


class Qwen2VisionTransformer(nn.Module):
    """One image at a time: ``pixel_values`` [grid_t * grid_h * grid_w, patch_dim] -> [tokens, hidden_size]."""

    def __init__(self, config: Qwen2VisionConfig) -> None:
        super().__init__()
        self.config = config
        # The Conv3d's kernel equals its stride: one matmul over the flattened patch (weight [embed, C, T, P, P]).
        self.patch_embed = nn.Parameter(torch.empty(config.embed_dim, config.in_channels, config.temporal_patch_size,
                                                    config.patch_size, config.patch_size))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def rotary(self, grid_t: int, grid_h: int, grid_w: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """cos, sin [P, 1, head_dim] of each patch in the processor's order (merge groups of m x m patches, row
        by row within a group): its row's angles on the first quarter of frequencies, its column's on the next."""
        head_dim = self.config.embed_dim // self.config.num_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32,
                                                                   device=device) / spatial))
        m = self.config.spatial_merge_size
        rows, cols = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device),
                                    indexing="ij")
        order = (grid_h // m, m, grid_w // m, m)
        rows = rows.reshape(order).transpose(1, 2).flatten().repeat(grid_t)
        cols = cols.reshape(order).transpose(1, 2).flatten().repeat(grid_t)
        freqs = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        weight = self.patch_embed
        x = pixels.to(weight.dtype) @ weight.reshape(len(weight), -1).t()
        cos, sin = self.rotary(*grid, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.merger(x)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> str:
        """Copies the checkpoint's ``visual.<name>`` into its parameter; returns the parameter's name. KeyError
        for a name with no place here."""
        own = name.replace("merger.mlp.0.", "merger.fc1.").replace("merger.mlp.2.", "merger.fc2.")
        own = own.replace("patch_embed.proj.weight", "patch_embed").replace(".attn.", ".").replace(".mlp.", ".")
        params = dict(self.named_parameters())
        if own not in params:
            raise KeyError(own)
        if params[own].shape != tensor.shape:
            raise ValueError(f"visual.{name}: checkpoint shape {tuple(tensor.shape)} != expected "
                             f"{tuple(params[own].shape)}")
        with torch.no_grad():
            params[own].copy_(tensor)
        return own
