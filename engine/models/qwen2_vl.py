"""Qwen2-VL (transformers' ``Qwen2VLForConditionalGeneration``): its vision transformer (``engine.models.
qwen2_vision``) and a Qwen2 language model whose rotary embedding is M-RoPE.

M-RoPE splits each head's rotary frequencies into ``mrope_section`` (temporal, height, width) sections, each rotated
by its own component of a token's 3-D position. Text tokens have three equal components; an image's placeholders
take (start + t, start + row, start + column) over its merged patch grid; the text after an image continues from
the image's largest position + 1. The runner computes these positions (``engine.worker.mrope``) from the request's
images and hands the model positions [3, T]; a step without them (decode graphs) passes [T], all sections equal.

Video inputs and Qwen2.5-VL (window attention in its vision transformer) are not supported.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionMetadata
from engine.device.kernel_choice import KernelChoice
from engine.distributed import ParallelContext
from engine.models.config import ModelConfig, config_from_hf
from engine.models.decoder_layer import Attention
from engine.models.layers.rotary import RotaryEmbedding, _rotate
from engine.models.llama import CausalLM, Intermediate
from engine.models.qwen2_vision import Qwen2VisionConfig, Qwen2VisionTransformer
from engine.models.weight_names import split_fused

# Row embeddings of one step's images, to write over their placeholders: flat rows [R] int64, embeddings [R, hidden].
MultiModalEmbeds = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Qwen2VLConfig:
    vision: Qwen2VisionConfig
    image_token_id: int


def qwen2_vl_config_from_hf(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None
                            ) -> tuple[ModelConfig, Qwen2VLConfig]:
    """(the language model's ModelConfig with ``mrope_section``, the rest) from a Qwen2-VL ``config.json``: the
    transformers 5 layout (``text_config``) or the hub's older flat one (``rope_scaling: {type: mrope}``)."""
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(f"qwen2_vl: rope mrope_section={section!r} must list 3 sections")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"qwen2_vl: rope type {rope_type!r} is not supported with M-RoPE (default)")
    theta = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
    text.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_scaling=None)
    image_token = int(cfg.get("image_token_id", 151655))
    config = config_from_hf(text, generation_cfg, has_lm_head=True)
    if sum(section) != config.rotary_dim // 2:
        raise ValueError(f"qwen2_vl: mrope_section {section} does not cover the {config.rotary_dim // 2} rotary "
                         "frequencies of a head")
    config = replace(config, image_token_id=image_token, mrope_section=tuple(int(s) for s in section))
    return config, Qwen2VLConfig(Qwen2VisionConfig.from_hf(cfg.get("vision_config") or {}), image_token)


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose frequency sections take the temporal / height / width components of positions [3, T] (transformers'
    ``apply_multimodal_rotary_pos_emb``); positions [T] rotate every section by the same position. Rotates in torch
    on every device (the fused kernels take one position per token)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.mrope_section is not None
        ends = [sum(config.mrope_section[:i + 1]) for i in range(len(config.mrope_section))]
        self.sections = list(zip([0, *ends[:-1]], ends))   # each section's [lo, hi) of the D/2 frequencies

    def use_kernels(self, choice: KernelChoice) -> None:
        return None

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        else:
            cos = torch.cat([self.cos_cache[positions[i], lo:hi] for i, (lo, hi) in enumerate(self.sections)], dim=-1)
            sin = torch.cat([self.sin_cache[positions[i], lo:hi] for i, (lo, hi) in enumerate(self.sections)], dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


class Qwen2VLForConditionalGeneration(CausalLM):
    """The language model (``CausalLM``'s layers, cache and logits, M-RoPE) with the vision transformer beside it.
    Tensor and pipeline parallelism are not supported: the merged embeddings exist on one rank."""

    def __init__(self, config: ModelConfig, qwen: Qwen2VLConfig, parallel: ParallelContext = ParallelContext()) -> None:
        if parallel.tp_size > 1 or parallel.pp_size > 1:
            raise ValueError("qwen2_vl: tensor and pipeline parallelism are not supported for vision-language models")
        super().__init__(config, parallel)
        self.qwen = qwen
        self.rotary = MRotaryEmbedding(config)
        for module in self.modules():
            if isinstance(module, Attention):
                module.rotary = self.rotary
        self.visual = Qwen2VisionTransformer(qwen.vision)

    @property
    def image_token_id(self) -> int:
        return self.qwen.image_token_id

    def vision_parameters(self) -> tuple[str, ...]:
        return ("visual.",)

    def language_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if not name.startswith(self.vision_parameters())}

    def _grid(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
        """An image's patch grid (t, h, w); ValueError for tensors the vision transformer cannot take."""
        pixels, grid = tensors.get("pixel_values"), tensors.get("image_grid_thw")
        vision = self.qwen.vision
        if pixels is None or grid is None or grid.numel() != 3 or grid.is_floating_point():
            raise ValueError("an image needs pixel_values [patches, "
                             f"{vision.patch_dim}] (float) and image_grid_thw [1, 3] (integer)")
        t, h, w = (int(v) for v in grid.reshape(-1).tolist())
        m = vision.spatial_merge_size
        if t != 1 or h <= 0 or w <= 0 or h % m or w % m:
            raise ValueError(f"image_grid_thw {[t, h, w]}: an image has t=1 and h, w positive multiples of {m}")
        if tuple(pixels.shape) != (t * h * w, vision.patch_dim) or not pixels.is_floating_point():
            raise ValueError(f"pixel_values must be a float tensor of shape {[t * h * w, vision.patch_dim]}, got "
                             f"{list(pixels.shape)}")
        return t, h, w

    def image_tokens(self, tensors: Mapping[str, torch.Tensor]) -> int:
        t, h, w = self.mrope_grid(tensors)
        return t * h * w

    def mrope_grid(self, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
        """The image's placeholders as a (t, h, w) grid: its patches merged ``spatial_merge_size`` squared."""
        t, h, w = self._grid(tensors)
        m = self.qwen.vision.spatial_merge_size
        return t, h // m, w // m

    def embed_image(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's ``pixel_values`` [patches, patch_dim] and ``image_grid_thw`` [1, 3] -> its placeholder rows'
        embeddings [patches / merge^2, hidden]."""
        grid = self._grid(tensors)
        return self.visual(tensors["pixel_values"].to(self.visual.patch_embed.device), grid)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Intermediate | None = None,
                inputs_embeds: torch.Tensor | None = None,
                mm_embeds: MultiModalEmbeds | None = None) -> torch.Tensor | Intermediate:
        """``CausalLM.forward`` with positions [3, T] or [T]; ``mm_embeds`` (flat rows, their embeddings) replace
        those rows' token embeddings."""
        if mm_embeds is not None and inputs_embeds is None:
            assert self.embed_tokens is not None
            rows, embeds = mm_embeds
            inputs_embeds = self.embed_tokens(input_ids).index_copy(0, rows, embeds.to(self.embed_tokens.weight.dtype))
        return super().forward(input_ids, positions, kv_caches, meta, intermediate, inputs_embeds=inputs_embeds)

    def load_qwen2_vl_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """A Qwen2-VL checkpoint's tensors (``visual.*`` / ``model.visual.*``; ``model.*`` /
        ``model.language_model.*`` and ``lm_head.*``): the language model's through ``CausalLM.load_weights``,
        the vision transformer's by name. Raises if one is missing or has no place."""
        own = {n.removeprefix("visual.") for n, _ in self.visual.named_parameters(prefix="visual")}
        loaded: set[str] = set()

        def language() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                short = name.removeprefix("model.")
                if short.startswith("visual."):
                    try:
                        loaded.add(self.visual.load_tensor(short.removeprefix("visual."), tensor))
                    except KeyError:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in this model") from None
                    continue
                yield name.replace("model.language_model.", "model.", 1), tensor

        self.load_weights(split_fused(language(), self.config, self.weight_shard))
        missing = sorted(own - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing vision weights for: {', '.join(missing[:8])}")


def load_weights_from(model: Qwen2VLForConditionalGeneration, files: list[Path]) -> None:
    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    model.load_qwen2_vl_weights(tensors())
