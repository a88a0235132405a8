"""The model's own default sampling parameters (vLLM's ``--generation-config auto|vllm|FOLDER``, default ``auto``):
``generation_config.json``'s temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
``max_tokens``) become the defaults of requests that do not set them, over REST, gRPC and the offline API. As vLLM
reads it (``get_diff_sampling_param``): only the values that differ from transformers' ``GenerationConfig``
defaults count (``top_k: 50`` is transformers' own default, not the model's choice); ``vllm`` uses none of them.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from common.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# generation_config.json key -> (the request field it defaults, transformers' GenerationConfig default)
_FIELDS: dict[str, tuple[str, Any]] = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0),
                                       "top_k": ("top_k", 50), "min_p": ("min_p", None),
                                       "repetition_penalty": ("repetition_penalty", 1.0),
                                       "max_new_tokens": ("max_tokens", None)}
FLAG = "generation_config"


def generation_defaults(setting: str, model_path: str) -> dict[str, Any]:
    """The request defaults ``setting`` (``auto``: the model's folder; ``vllm``: none; else a folder) gives."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        folder = Path(model_path)
        if not folder.is_dir():   # a GGUF file: no generation_config.json
            return {}
    else:
        folder = Path(setting)
        if not (folder / "generation_config.json").is_file():
            raise InvalidRequestError(FLAG, f"{setting!r} holds no generation_config.json (give auto, vllm or a "
                                            "folder with one)")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(FLAG, f"{path} cannot be read: {e}") from e
    out: dict[str, Any] = {}
    for key, (field, hf_default) in _FIELDS.items():
        value = raw.get(key)
        if value is not None and value != hf_default:
            out[field] = value
    return out


def log_defaults(defaults: dict[str, Any], setting: str) -> None:
    if defaults:
        logger.info("default sampling parameters from the model's generation_config.json (--generation-config %s): "
                    "%s; requests that set a field keep theirs", setting,
                    ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    else:
        logger.info("default sampling parameters: vLLM's own (--generation-config %s)", setting)
