"""``LoRARequest``: which LoRA adapter a request runs through (vLLM's ``vllm.lora.request.LoRARequest``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) under a name and an id.

    ``lora_int_id`` identifies the adapter's weights everywhere in the engine (the worker's adapter slots, the
    prefix cache's block hashes, the scheduler's ``--max-loras`` count): two requests with the same id must mean
    the same weights, and a different adapter must get a different id. It is positive (vLLM's rule).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
