"""Shared body of the accelerator backends: torch.cuda and torch.npu expose the same stream, event,
memory and graph API, so CUDA and NPU differ only in which module they drive (and their graph class)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.device.base import Device

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend


class AcceleratorDevice(Device):
    """A device driven through a torch.cuda-like module (``torch.cuda``, ``torch.npu``)."""

    def __init__(self, name: str, module: Any, index: int = 0, place: torch.device | None = None) -> None:
        """``place``: where tensors live, when not ``torch.device(name, index)`` (see ``NpuDevice``)."""
        self.name = name
        self._mod = module
        self._device = place if place is not None else torch.device(name, index)
        module.set_device(self._device)

    @property
    def torch_device(self) -> torch.device:
        return self._device

    @property
    def pin_memory(self) -> bool:
        return True

    def new_stream(self) -> Any:
        return self._mod.Stream(self._device)

    def new_event(self) -> Any:
        return self._mod.Event()

    def current_stream(self) -> Any:
        return self._mod.current_stream()

    def new_graph(self) -> Any:
        """An empty graph to capture into (``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``)."""
        raise NotImplementedError(f"{self.name} names no graph class")

    def graph_pool(self) -> Any:
        """A memory pool token for graphs to share (``graph_pool_handle``)."""
        return self._mod.graph_pool_handle()

    def capture(self, graph: Any, pool: Any) -> contextlib.AbstractContextManager[Any]:
        """Captures the enclosed work into ``graph`` (``torch.cuda.graph`` / ``torch.npu.graph``: on a side stream
        of their own, allocating from ``pool``)."""
        capturing: contextlib.AbstractContextManager[Any] = self._mod.graph(graph, pool=pool)
        return capturing

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self._mod.stream(stream):
            yield

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_event(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self._mod.synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        free, total = self._mod.mem_get_info(self._device)
        return int(free), int(total)

    def peak_memory_allocated(self) -> int:
        return int(self._mod.max_memory_allocated(self._device))

    def reset_peak_memory(self) -> None:
        self._mod.reset_peak_memory_stats(self._device)

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self._mod.manual_seed_all(seed)

    def attention_backend(self) -> AttentionBackend:
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
