"""LLaVA-1.5 (transformers' ``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and a
decoder-only language model (``CausalLM``: Llama, Mistral, Qwen2...).

An image's pixel values go through the tower; the hidden states of ``vision_feature_layer`` (its CLS position
dropped under the "default" ``vision_feature_select_strategy``) are projected to the language model's width, one
row per placeholder token of the image in the prompt, and those rows replace the placeholders' embeddings. The
engine runs the tower inside the step (``engine.worker.multimodal``); the language model is the engine's own.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.distributed import ParallelContext
from engine.models.clip_vision import ClipVisionConfig, ClipVisionTower
from engine.models.config import ModelConfig, config_from_hf
from engine.models.llama import CausalLM, Intermediate
from engine.models.weight_names import split_fused

# transformers' LlamaConfig defaults: llava-hf's config.json lists only what differs from them in text_config.
_LLAMA_DEFAULTS: dict[str, Any] = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                       num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                                       rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
_PROJECTOR_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "silu")
# Row embeddings of one step's images, to write over their placeholders: flat rows [R] int64, embeddings [R, hidden].
MultiModalEmbeds = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LlavaConfig:
    """What a LLaVA checkpoint says beyond its language model's ModelConfig."""

    vision: ClipVisionConfig
    image_token_id: int
    feature_layer: int
    select_strategy: str              # "default": drop the CLS position; "full": keep it
    projector_act: str = "gelu"
    projector_bias: bool = True

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches + (self.select_strategy == "full")


def llava_config_from_hf(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None
                         ) -> tuple[ModelConfig, LlavaConfig]:
    """(the language model's ModelConfig, the rest) from a LLaVA ``config.json`` (and ``generation_config.json``:
    its eos ids join the model's). Raises ValueError naming what is not supported: several feature layers, a
    strategy other than default / full, a projector activation."""
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"llava: vision_feature_layer={layer!r} (several layers) is not supported")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"llava: vision_feature_select_strategy={strategy!r} is not supported (default, full)")
    act = cfg.get("projector_hidden_act", "gelu")
    if act not in _PROJECTOR_ACTIVATIONS:
        raise ValueError(f"llava: projector_hidden_act={act!r} is not supported ({', '.join(_PROJECTOR_ACTIVATIONS)})")
    text = dict(cfg.get("text_config") or {})
    text.setdefault("model_type", "llama")
    if text["model_type"] == "llama":
        text = {**_LLAMA_DEFAULTS, **text}
    image_token = cfg.get("image_token_id", cfg.get("image_token_index", 32000))
    config = replace(config_from_hf(text, generation_cfg, has_lm_head=True), image_token_id=int(image_token))
    return config, LlavaConfig(vision=ClipVisionConfig.from_hf(cfg.get("vision_config") or {}),
                               image_token_id=int(image_token), feature_layer=layer, select_strategy=strategy,
                               projector_act=act, projector_bias=bool(cfg.get("multimodal_projector_bias", True)))


class LlavaProjector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(x)
        x = F.gelu(x) if self.act == "gelu" else F.gelu(x, approximate="tanh") if self.act == "gelu_pytorch_tanh" \
            else F.silu(x)
        return self.linear_2(x)


class LlavaForConditionalGeneration(CausalLM):
    """The language model (``CausalLM``'s layers, cache and logits) with a vision tower and projector beside it.
    Tensor and pipeline parallelism are not supported: the merged embeddings exist on one rank."""

    def __init__(self, config: ModelConfig, llava: LlavaConfig, parallel: ParallelContext = ParallelContext()) -> None:
        if parallel.tp_size > 1 or parallel.pp_size > 1:
            raise ValueError("llava: tensor and pipeline parallelism are not supported for vision-language models")
        super().__init__(config, parallel)
        self.llava = llava
        self.vision_tower = ClipVisionTower(llava.vision, llava.feature_layer)
        self.multi_modal_projector = LlavaProjector(llava.vision.hidden_size, config.hidden_size,
                                                    llava.projector_act, llava.projector_bias)

    @property
    def image_token_id(self) -> int:
        return self.llava.image_token_id

    def vision_parameters(self) -> tuple[str, ...]:
        """Name prefixes of the parameters beside the language model's (loaded by name, not as a causal LM's)."""
        return "vision_tower.", "multi_modal_projector."

    def language_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if not name.startswith(self.vision_parameters())}

    def image_tokens(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """How many placeholder embeddings ``embed_image`` makes of an image's tensors; ValueError naming what the
        tower cannot take (checked when a request is added, so that a step never meets it)."""
        pixels = tensors.get("pixel_values")
        vision = self.llava.vision
        want = (1, vision.num_channels, vision.image_size, vision.image_size)
        if pixels is None or tuple(pixels.shape) not in (want, want[1:]) or not pixels.is_floating_point():
            raise ValueError(f"pixel_values must be a float tensor of shape {list(want)}, got "
                             f"{None if pixels is None else list(pixels.shape)}")
        return self.llava.tokens_per_image

    def embed_image(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor outputs (``pixel_values`` [1, C, H, W] or [C, H, W]) -> its placeholder rows'
        embeddings [tokens_per_image, hidden], in the model's dtype."""
        pixels = tensors.get("pixel_values")
        if pixels is None:
            raise ValueError("llava: an image item needs pixel_values")
        pixels = pixels.to(self.multi_modal_projector.linear_1.weight.device)
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        if pixels.dim() != 4 or pixels.shape[0] != 1:
            raise ValueError(f"llava: pixel_values of one image must be [1, C, H, W], got {tuple(pixels.shape)}")
        features = self.vision_tower(pixels)
        if self.llava.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: Intermediate | None = None,
                inputs_embeds: torch.Tensor | None = None,
                mm_embeds: MultiModalEmbeds | None = None) -> torch.Tensor | Intermediate:
        """``CausalLM.forward``; ``mm_embeds`` (flat rows, their embeddings) replace those rows' token embeddings."""
        if mm_embeds is not None and inputs_embeds is None:
            assert self.embed_tokens is not None
            rows, embeds = mm_embeds
            inputs_embeds = self.embed_tokens(input_ids).index_copy(0, rows, embeds.to(self.embed_tokens.weight.dtype))
        return super().forward(input_ids, positions, kv_caches, meta, intermediate, inputs_embeds=inputs_embeds)

    def load_llava_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """A LLaVA checkpoint's tensors, in either transformers layout (``language_model.model.*`` /
        ``model.language_model.*``, ``vision_tower[.vision_model].*``, ``multi_modal_projector.*``): the language
        model's through ``CausalLM.load_weights``, the tower's and projector's by name. Raises if one is missing."""
        own = {n: p for n, p in self.named_parameters() if n.startswith(self.vision_parameters())}
        loaded: set[str] = set()

        def language() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                target = _own_name(name, self.vision_parameters())
                if target is None:
                    yield _language_name(name), tensor
                    continue
                if target not in own:
                    if target.startswith(("vision_tower.encoder.layers.", "vision_tower.post_layernorm.")):
                        continue   # a layer past the feature layer, or the pooled output's norm: never run
                    raise ValueError(f"checkpoint tensor {name!r} has no place in this model ({target!r})")
                if own[target].shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected "
                                     f"{tuple(own[target].shape)}")
                with torch.no_grad():
                    own[target].copy_(tensor)
                loaded.add(target)

        self.load_weights(split_fused(language(), self.config, self.weight_shard))
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")


def _own_name(name: str, prefixes: tuple[str, ...]) -> str | None:
    """The tower's, projector's (or another non-language) parameter a checkpoint tensor fills, None for the language
    model's: ``vision_tower.vision_model.X`` / ``model.vision_tower.X`` -> ``vision_tower.X``."""
    name = name.removeprefix("model.")
    if not name.startswith(prefixes):
        return None
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


def _language_name(name: str) -> str:
    """A language-model tensor's name as a plain causal LM's checkpoint names it (``model.layers.*``,
    ``lm_head.weight``), from either transformers layout (``language_model.model.*``, ``model.language_model.*``)."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("language_model.", "model.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def load_weights_from(model: LlavaForConditionalGeneration, files: list[Path]) -> None:
    """Every tensor of the checkpoint's safetensors ``files`` into ``model`` (``load_llava_weights``)."""
    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    model.load_llava_weights(tensors())
