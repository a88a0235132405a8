"""KV offload tiers (``--kv-offloading-size`` / ``--kv-offloading-backend``): blocks the device pool evicts are kept
in host memory or on disk and loaded back on a prefix miss.

Shaped as a KV connector as vLLM splits one: the scheduler half (``connector``: the tier's index, which blocks to
store and load each step, the requests waiting for their blocks) and the worker half
(``engine.worker.kv_transfer``: the copies between the device cache and the tier), joined by the
``KVTransfer`` each ``SchedulerOutput`` carries and the ``RunnerOutput.kv_loads`` report.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.kv_offload.connector import TIER_MEDIUM, OffloadConnector
from engine.core.kv_offload.tier_index import TierIndex
from engine.worker.kv_transfer import tier_slots

if TYPE_CHECKING:
    from engine.models import ModelConfig

_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_block_bytes(model_config: ModelConfig, block_size: int, kv_cache_dtype_name: str) -> int:
    """Bytes of one KV block in every layer of a one-rank engine (as the worker lays its caches out)."""
    mla = model_config.mla
    planes, heads = (1, 1) if mla is not None else (2, model_config.num_kv_heads)
    width = mla.latent_dim if mla is not None else model_config.head_dim
    return planes * model_config.num_layers * block_size * heads * width * _ELEMENT_BYTES[kv_cache_dtype_name]


def num_tier_slots(config: EngineConfig, model_config: ModelConfig, kv_cache_dtype_name: str) -> int | None:
    """How many blocks the configured tier holds; None when there is no tier."""
    offload = config.kv_offloading_config
    if offload is None:
        return None
    return tier_slots(offload.size_bytes, kv_block_bytes(model_config, config.block_size, kv_cache_dtype_name),
                      offload.backend)


__all__ = ["OffloadConnector", "TIER_MEDIUM", "TierIndex", "kv_block_bytes", "num_tier_slots"]
