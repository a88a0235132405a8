"""The vision-language families the engine runs, by config.json ``model_type``: their language model's
ModelConfig, and the whole model loaded from a Hugging Face directory."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.distributed import ParallelContext
from engine.models.config import ModelConfig
from engine.models.llava import LlavaForConditionalGeneration, llava_config_from_hf, load_weights_from
from engine.models.llava_next import LlavaNextForConditionalGeneration, llava_next_config_from_hf

MODEL_TYPES = ("llava", "llava_next")


def language_config(cfg: dict[str, Any]) -> ModelConfig:
    """The language model's ModelConfig (with ``image_token_id``) of a vision-language config.json."""
    if cfg.get("model_type") == "llava_next":
        return llava_next_config_from_hf(cfg)[0]
    return llava_config_from_hf(cfg)[0]


def load_vision_language(directory: Path, files: list[Path], dtype: torch.dtype, device: torch.device | str = "cpu",
                         parallel: ParallelContext = ParallelContext(), quantization: str | None = None
                         ) -> LlavaForConditionalGeneration:
    """The model of a LLaVA-1.5 or LLaVA-NeXT directory (its safetensors ``files``) in ``dtype`` on ``device``."""
    cfg = json.loads((directory / "config.json").read_text())
    generation = directory / "generation_config.json"
    gen_cfg = json.loads(generation.read_text()) if generation.is_file() else None
    kind = cfg.get("model_type")
    if quantization is not None:
        raise ValueError(f"{kind}: --quantization {quantization} is not supported for vision-language models")
    model: LlavaForConditionalGeneration
    with torch.device("meta"):
        if kind == "llava_next":
            config, next_config = llava_next_config_from_hf(cfg, gen_cfg)
            model = LlavaNextForConditionalGeneration(config, next_config, parallel)
        else:
            config, llava = llava_config_from_hf(cfg, gen_cfg)
            model = LlavaForConditionalGeneration(config, llava, parallel)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary.build_cache(device, dtype)
    load_weights_from(model, files)
    return model.eval().requires_grad_(False)
