"""LoRA adapters at the text level: the names a request's ``model`` may take besides the served model's.

Adapters share the base model's tokenizer, so the service needs only their names. The engine owns the list
(GetInfo) and resolves ``EngineGenerateRequest.lora_adapter`` itself; what the service keeps is a copy for the
calls that never reach the engine (Tokenize, Detokenize, ApplyChatTemplate, GetModelInfo), refreshed on a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import NotFoundError
from proto.sluice.v1 import common_pb2


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    base_model_name: str


def adapters_from_pb(adapters: list[common_pb2.LoRAAdapter]) -> tuple[LoRAAdapter, ...]:
    return tuple(LoRAAdapter(a.name, a.base_model_name) for a in adapters)


def adapters_to_pb(adapters: tuple[LoRAAdapter, ...]) -> list[common_pb2.LoRAAdapter]:
    return [common_pb2.LoRAAdapter(name=a.name, base_model_name=a.base_model_name) for a in adapters]


def model_not_found(model: str, served: str, *, lora_enabled: bool) -> NotFoundError:
    """NOT_FOUND for a ``model`` that is neither the served model nor an adapter (OpenAI's 404
    model_not_found)."""
    model = model[:200]  # a client's string, echoed: bounded
    if lora_enabled:
        details = f"model: {model!r} is neither the served model {served!r} nor a loaded LoRA adapter"
    else:
        details = f"model: {model!r} is not served here (serving {served!r}; LoRA adapters need --enable-lora)"
    return NotFoundError(details)
