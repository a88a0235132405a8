"""The context a Hugging Face ``config.json`` declares, read the same way by the engine's model config and by the
processes that size their receive limits before any model loads (and without importing torch)."""
from __future__ import annotations

from typing import Any

# The loaders' default when a model does not say.
DEFAULT_CONTEXT_LENGTH = 4096


def declared_context(cfg: dict[str, Any]) -> int:
    """``max_position_embeddings``, times the factor of a dynamic-NTK rope (the context its raised base is made
    for, as vLLM derives it)."""
    context = int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type")) == "dynamic":
        context = int(context * float(scaling["factor"]))
    return context
