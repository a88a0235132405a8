"""Sluice engine: continuous batching, paged KV cache, and the offline ``LLM`` API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.errors import EngineDeadError, InvalidRequestError, QueueFullError, SluiceError
from engine.config import EngineConfig
from engine.core.lora_request import LoRARequest
from engine.core.outputs import CompletionOutput, Logprob, RequestOutput
from engine.core.pooling_params import PoolingParams
from engine.core.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from engine.entrypoints.llm import LLM, BeamSearchParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "BeamSearchParams",
           "LoRARequest", "PoolingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob",
           "InvalidRequestError", "QueueFullError", "EngineDeadError", "SluiceError"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the models; import it only when asked for.
    if name in ("LLM", "BeamSearchParams"):
        from engine.entrypoints import llm

        return getattr(llm, name)
    raise AttributeError(name)
