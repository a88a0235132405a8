"""Model implementations (the Llama block family) and their loaders."""
from __future__ import annotations

from engine.models.config import ModelConfig, RopeScaling
from engine.models.dtype import resolve_dtype
from engine.models.llama import CausalLM, build_model
from engine.models.loader import load_model
from engine.models.sharding import check_parallel_sizes

__all__ = ["CausalLM", "ModelConfig", "RopeScaling", "build_model", "check_parallel_sizes", "load_model",
           "resolve_dtype"]
