"""Ascend NPU backend through torch-npu.

``torch_npu`` is imported here only, and this module is imported only when
``--device npu`` is chosen, so the engine runs and is tested without it.
NOT RUN ON REAL HARDWARE: no Ascend device was available while writing it;
it follows torch-npu's documented stream/event/memory API, which mirrors
torch.cuda. Attention uses the same PyTorch paged-attention code as CUDA/CPU;
torch-npu's fused operators (npu_fused_infer_attention_score,
_npu_reshape_and_cache, _npu_paged_attention) are the next step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.device.base import Device

if TYPE_CHECKING:
    from engine.attention import AttentionBackend


class NpuDevice(Device):
    name = "npu"

    def __init__(self, index: int = 0) -> None:
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as e:
            raise RuntimeError("device 'npu' needs torch_npu (Ascend CANN + torch-npu) installed") from e
        self._npu: Any = torch.npu  # type: ignore[attr-defined]
        if not self._npu.is_available():
            raise RuntimeError("device 'npu' was chosen but torch_npu sees no NPU")
        self._device = torch.device("npu", index)
        self._npu.set_device(self._device)

    @property
    def torch_device(self) -> torch.device:
        return self._device

    @property
    def pin_memory(self) -> bool:
        return True

    def new_stream(self) -> Any:
        return self._npu.Stream(self._device)

    def new_event(self) -> Any:
        return self._npu.Event()

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self._npu.stream(stream):
            yield

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_event(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def synchronize_event(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self._npu.synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        free, total = self._npu.mem_get_info(self._device)
        return int(free), int(total)

    def peak_memory_allocated(self) -> int:
        return int(self._npu.max_memory_allocated(self._device))

    def reset_peak_memory(self) -> None:
        self._npu.reset_peak_memory_stats(self._device)

    def attention_backend(self) -> AttentionBackend:
        from engine.attention import TorchAttentionBackend

        return TorchAttentionBackend()
