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
from engine.models.qwen2_vl import Qwen2VLForConditionalGeneration, qwen2_vl_config_from_hf
from engine.models.qwen2_vl import load_weights_from as load_qwen2_vl_weights

MODEL_TYPES = ("llava", "llava_next", "qwen2_vl")
# Families refused by name (ValueError) rather than read as another.
REFUSED = {"qwen2_5_vl": "Qwen2.5-VL (its vision transformer's window attention) is not supported; Qwen2-VL is"}


def language_config(cfg: dict[str, Any]) -> ModelConfig:
    """The language model's ModelConfig (with ``image_token_id``) of a vision-language config.json."""
    check_supported(cfg)
    if cfg.get("model_type") == "llava_next":
        return llava_next_config_from_hf(cfg)[0]
    if cfg.get("model_type") == "qwen2_vl":
        return qwen2_vl_config_from_hf(cfg)[0]
    return llava_config_from_hf(cfg)[0]


def load_vision_language(directory: Path, files: list[Path], dtype: torch.dtype, device: torch.device | str = "cpu",
                         parallel: ParallelContext = ParallelContext(), quantization: str | None = None
                         ) -> LlavaForConditionalGeneration | Qwen2VLForConditionalGeneration:
    """The model of a LLaVA-1.5, LLaVA-NeXT or Qwen2-VL directory (its safetensors ``files``) in ``dtype`` on
    ``device``."""
    cfg = json.loads((directory / "config.json").read_text())
    generation = directory / "generation_config.json"
    gen_cfg = json.loads(generation.read_text()) if generation.is_file() else None
    kind = cfg.get("model_type")
    check_supported(cfg)
    if quantization is not None:
        raise ValueError(f"{kind}: --quantization {quantization} is not supported for vision-language models")
    if kind == "qwen2_vl":
        with torch.device("meta"):
            config, qwen = qwen2_vl_config_from_hf(cfg, gen_cfg)
            qwen_model = Qwen2VLForConditionalGeneration(config, qwen, parallel)
        qwen_model = qwen_model.to(dtype=dtype).to_empty(device=device)
        qwen_model.tie_weights()
        qwen_model.rotary.build_cache(device, dtype)
        load_qwen2_vl_weights(qwen_model, files)
        return qwen_model.eval().requires_grad_(False)
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


def check_supported(cfg: dict[str, Any]) -> None:
    """ValueError naming a vision-language family the engine does not run (``REFUSED``)."""
    reason = REFUSED.get(str(cfg.get("model_type")))
    if reason is not None:
        raise ValueError(f"{cfg.get('model_type')}: {reason}")
