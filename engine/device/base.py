"""The device interface every backend implements (cpu, cuda, npu).

The runner only talks to this: streams and events so copy, compute and
copy-back can overlap, synchronize, memory info, and the attention kernels.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.attention.backend import AttentionBackend
from engine.device.kernel_choice import KernelChoice


class Device(ABC):
    """One accelerator (or the host CPU) as the runner sees it."""

    name: str

    @property
    @abstractmethod
    def torch_device(self) -> torch.device: ...

    @property
    def pin_memory(self) -> bool:
        """Whether host staging buffers should be pinned (page-locked) for async copies."""
        return False

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream (queue of device work); a no-op object on CPU."""

    @abstractmethod
    def new_event(self) -> Any:
        """A new event that can be recorded on one stream and waited on by another."""

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Issue the enclosed work on ``stream``."""
        yield

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (no host blocking)."""

    def record_event(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``."""

    def synchronize_event(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""

    def synchronize(self) -> None:
        """Block the host until all work on the device has completed."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the memory the KV cache lives in."""

    def peak_memory_allocated(self) -> int:
        return 0

    def reset_peak_memory(self) -> None:
        """Start a fresh peak-memory measurement (for KV cache sizing)."""

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    @abstractmethod
    def attention_backend(self) -> AttentionBackend:
        """The attention kernels: KV write by slot mapping, prefill and paged decode attention."""

    def kernel_choice(self, dtype: torch.dtype, amx_pack_bytes: int = 0, int8_layers: int = 0) -> KernelChoice:
        """The kernels this device offers a ``dtype`` model's layers (they pick theirs once, at load);
        ``amx_pack_bytes``: what tile-packed weight copies would cost; ``int8_layers``: how many W8A8 layers the
        model has (none: the int8 path is not looked at). Default: PyTorch ops."""
        return KernelChoice.torch()

    def row_argmax(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A faster ``torch.argmax(x, -1)`` for float32 (or bfloat16) logits on this device, or None (torch's)."""
        return None

    def empty_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory for a KV cache (uninitialised; the attention backend lays it out and zeroes it)."""
        return torch.empty(shape, dtype=dtype, device=self.torch_device)


