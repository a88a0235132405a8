"""The engine servicer's LoRA side: adapter names on the wire, the status codes of LoRA refusals, and the runtime
Load / Unload RPCs.

Loading reads the adapter's folder: it runs on the engine thread through ``AsyncEngine.call``, between steps (the
executor that reads it is the one the steps use), never on the event loop. A load or an unload that the engine
took on completes even if its caller goes away, so the registry's names and the core's adapters never disagree.
"""

from __future__ import annotations

import asyncio

from common.errors import InvalidRequestError
from engine.core.lora_request import LoRARequest
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.lora_registry import (
    LoRARegistry,
)
from proto.sluice.v1 import common_pb2


def adapter_to_pb(registry: LoRARegistry, lora: LoRARequest) -> common_pb2.LoRAAdapter:
    return common_pb2.LoRAAdapter(name=lora.lora_name, base_model_name=registry.parent(lora))


def adapters_to_pb(registry: LoRARegistry) -> list[common_pb2.LoRAAdapter]:
    return [adapter_to_pb(registry, lora) for lora in registry.adapters()]


async def load_adapter(engine: AsyncEngine, registry: LoRARegistry, request: common_pb2.LoadLoRAAdapterRequest
                       ) -> common_pb2.LoadLoRAAdapterResponse:
    """Load an adapter under a new name; listed once the core has loaded and validated it."""
    registry.check_runtime_updates()
    lora = registry.reserve(request.lora_name, request.lora_path, request.base_model_name or None)

    async def load() -> None:
        try:
            await engine.call(lambda core: core.add_lora(lora))
        except BaseException:
            registry.release(lora)
            raise
        registry.commit(lora)

    await asyncio.shield(load())
    return common_pb2.LoadLoRAAdapterResponse(adapter=adapter_to_pb(registry, lora))


async def unload_adapter(engine: AsyncEngine, registry: LoRARegistry, request: common_pb2.UnloadLoRAAdapterRequest
                         ) -> common_pb2.UnloadLoRAAdapterResponse:
    """Unlist an adapter now; the core frees its weights once the requests running with it have ended."""
    registry.check_runtime_updates()
    if not request.lora_name:
        raise InvalidRequestError("lora_name", "is required")
    lora = registry.remove(request.lora_name)
    await asyncio.shield(engine.call(lambda core: core.remove_lora(lora.lora_int_id)))
    return common_pb2.UnloadLoRAAdapterResponse()
