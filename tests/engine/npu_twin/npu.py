"""TEST-ONLY TWIN of ``torch.npu`` (what importing torch-npu registers; also ``torch_npu.npu``): the stream, event,
memory and seed calls (``device``) and graph mode (``graph``)."""
from __future__ import annotations

from tests.engine.npu_twin.device import (
    Event,
    Stream,
    current_device,
    current_stream,
    device_count,
    empty_cache,
    is_available,
    is_current_stream_capturing,
    manual_seed_all,
    max_memory_allocated,
    mem_get_info,
    reset_peak_memory_stats,
    set_device,
    stream,
    synchronize,
)
from tests.engine.npu_twin.graph import (
    CAPTURED,
    ExternalEvent,
    NPUGraph,
    graph,
    graph_pool_handle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)

__all__ = ["Event", "Stream", "current_device", "current_stream", "device_count", "empty_cache", "is_available",
           "is_current_stream_capturing", "manual_seed_all", "max_memory_allocated", "mem_get_info",
           "reset_peak_memory_stats", "set_device", "stream", "synchronize", "CAPTURED", "ExternalEvent", "NPUGraph",
           "graph", "graph_pool_handle", "graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin",
           "graph_task_update_end"]
