"""CUDA backend: real streams and events; attention through PyTorch (SDPA + block-table gather)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.device.base import Device

if TYPE_CHECKING:
    from engine.attention import AttentionBackend


class CudaDevice(Device):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was chosen but torch sees no CUDA device")
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)

    @property
    def torch_device(self) -> torch.device:
        return self._device

    @property
    def pin_memory(self) -> bool:
        return True

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self._device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_event(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self._device)
        return int(free), int(total)

    def peak_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._device))

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def attention_backend(self) -> AttentionBackend:
        from engine.attention import TorchAttentionBackend

        return TorchAttentionBackend()
