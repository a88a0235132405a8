"""LLaVA-NeXT (transformers' ``LlavaNextForConditionalGeneration``): LLaVA-1.5's tower, projector and language model
with any-resolution tiling. An image is resized to the best of ``image_grid_pinpoints`` and cut into tower-sized
tiles, plus one base tile of the whole image; the tiles' features are laid out as the grid they came from, the
rows and columns that are only padding of the resized image dropped ("unpadded"), a learned ``image_newline``
appended to each row, and the base tile's features put first (transformers' ``pack_image_features``)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.distributed import ParallelContext
from engine.models.config import ModelConfig
from engine.models.llava import LlavaConfig, LlavaForConditionalGeneration, llava_config_from_hf


@dataclass(frozen=True)
class LlavaNextConfig:
    llava: LlavaConfig
    grid_pinpoints: tuple[tuple[int, int], ...]   # (height, width) resolutions an image may be resized to


def llava_next_config_from_hf(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None
                              ) -> tuple[ModelConfig, LlavaNextConfig]:
    config, llava = llava_config_from_hf(cfg, generation_cfg)
    pinpoints = tuple((int(h), int(w)) for h, w in cfg.get("image_grid_pinpoints") or ())
    if not pinpoints:
        raise ValueError("llava_next: image_grid_pinpoints is required")
    if llava.select_strategy != "default":
        raise ValueError(f"llava_next: vision_feature_select_strategy={llava.select_strategy!r} is not supported "
                         "(default)")
    return config, LlavaNextConfig(llava, pinpoints)


def select_best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The pinpoint that keeps most of the image's pixels, then wastes the fewest (LLaVA-NeXT's rule)."""
    best, best_effective, best_wasted = pinpoints[0], -1, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    return best


def unpad(features: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[C, H', W'] grid features of an image of ``height`` x ``width`` resized into the grid: the rows or columns
    that cover only the padding around it dropped."""
    current_h, current_w = features.shape[1:]
    if width / height > current_w / current_h:
        new_h = int(round(height * (current_w / width), 7))
        pad = (current_h - new_h) // 2
        return features[:, pad:current_h - pad, :]
    new_w = int(round(width * (current_h / height), 7))
    pad = (current_w - new_w) // 2
    return features[:, :, pad:current_w - pad]


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    def __init__(self, config: ModelConfig, next_config: LlavaNextConfig,
                 parallel: ParallelContext = ParallelContext()) -> None:
        super().__init__(config, next_config.llava, parallel)
        self.grid_pinpoints = next_config.grid_pinpoints
        self.image_newline = nn.Parameter(torch.empty(config.hidden_size))

    def vision_parameters(self) -> tuple[str, ...]:
        return (*super().vision_parameters(), "image_newline")

    def _grid(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int, int, int]:
        """(image height, width, grid rows, grid columns) of an image's tensors; ValueError for shapes the tower
        cannot take."""
        pixels, sizes = tensors.get("pixel_values"), tensors.get("image_sizes")
        vision = self.llava.vision
        if (pixels is None or sizes is None or pixels.dim() != 5 or pixels.shape[0] != 1 or sizes.numel() != 2
                or tuple(pixels.shape[2:]) != (vision.num_channels, vision.image_size, vision.image_size)
                or not pixels.is_floating_point()):
            raise ValueError(f"an image needs pixel_values [1, tiles, {vision.num_channels}, {vision.image_size}, "
                             f"{vision.image_size}] (float) and image_sizes [1, 2]")
        height, width = (int(v) for v in sizes.reshape(-1).tolist())
        if height <= 0 or width <= 0:
            raise ValueError(f"image_sizes {[height, width]} must be positive")
        tile = vision.image_size
        best_h, best_w = select_best_resolution(height, width, self.grid_pinpoints)
        rows, cols = best_h // tile, best_w // tile
        if pixels.shape[1] < rows * cols + 1:
            raise ValueError(f"{pixels.shape[1]} tiles for an image of {height}x{width} (needs {rows * cols + 1})")
        return height, width, rows, cols

    def image_tokens(self, tensors: Mapping[str, torch.Tensor]) -> int:
        height, width, rows, cols = self._grid(tensors)
        side = self.llava.vision.image_size // self.llava.vision.patch_size
        grid = unpad(torch.empty(0, side * rows, side * cols, device="meta"), height, width)
        return side * side + grid.shape[1] * (grid.shape[2] + 1)   # the base tile, then each row and its newline

    def embed_image(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's ``pixel_values`` [1, tiles, C, H, W] (tiles past the image's own count are ignored) and
        ``image_sizes`` [1, 2] (height, width) -> its placeholder rows' embeddings [tokens, hidden]."""
        height, width, rows, cols = self._grid(tensors)
        pixels = tensors["pixel_values"]
        tile = self.llava.vision.image_size
        device = self.image_newline.device
        features = self.vision_tower(pixels[0, :rows * cols + 1].to(device))
        if self.llava.select_strategy == "default":
            features = features[:, 1:]
        features = self.multi_modal_projector(features)   # [tiles, side * side, hidden]
        base, grid = features[0], features[1:]
        side = tile // self.llava.vision.patch_size
        grid = grid.view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        grid = unpad(grid, height, width)
        newline = self.image_newline[:, None, None].expand(*grid.shape[:-1], 1).to(grid.dtype)
        grid = torch.cat((grid, newline), dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat((base, grid), dim=0)
