"""Sluice engine: continuous batching, paged KV cache, and the offline ``LLM`` API."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# Set before torch loads its OpenMP runtime (nothing in this package imports torch at import time).
# OpenMP workers that spin while they wait fight the tokenizer's own threads and the other processes
# of the stack for the cores: measured on 2 cores, the same LLM.generate took 46.8 s on the main
# thread with spinning workers and 1.8 s with sleeping ones. Users who want spinning can set it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, QueueFullError, SluiceError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "InvalidRequestError", "QueueFullError", "EngineDeadError", "SluiceError"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the models; import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
