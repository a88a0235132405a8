"""The device interface every backend implements (cpu, cuda, npu).

The runner only talks to this: streams and events so copy, compute and
copy-back can overlap, synchronize, memory info, and the attention kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import platform
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.env import switched_on

if TYPE_CHECKING:
    from engine.attention.torch_backend import AttentionBackend

logger = logging.getLogger(__name__)


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

    def prepare_model(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Rewrite a loaded model's weights into this device's fastest layout (default: leave them)."""

    def row_argmax(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A faster ``torch.argmax(x, -1)`` for float32 (or bfloat16) logits on this device, or None (torch's)."""
        return None

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One layer's KV cache, zeroed: padded block-table entries are gathered then masked, and
        uninitialised memory could hold NaNs that a zero attention weight does not cancel."""
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)


ENV_KV_HUGE_PAGES = "SLUICE_KV_HUGE_PAGES"
_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of a CPU tensor's memory, before it is first
    written: the kernel then backs it with transparent huge pages (in THP mode "madvise" as in "always").
    Returns the bytes advised; 0 where the tensor is too small, off Linux or when the call fails."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = end // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return 0
    return hi - lo


ENV_MALLOC_TUNING = "SLUICE_MALLOC_TUNING"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2): blocks up to this size come from the
# heap; the heap gives memory back to the kernel only once 1 GiB at its top is free.
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 1 << 30
_malloc_tuned: bool | None = None


def tune_malloc() -> bool:
    """Keep freed activation memory in the process for the next step (glibc; once per process).

    A CPU step allocates and frees its activations layer by layer: a 2048-token prefill's gate/up output
    alone is 12 MiB. With glibc's defaults such blocks may be mmap'd and unmapped again, or the heap top
    trimmed once a layer's temporaries are freed, and the next step faults the pages in (the kernel zeroing
    each) again. Whether that happens depends on the process's allocation history: measured in-process
    (``LLM.generate`` on the main thread, bfloat16 on 2 cores), some processes took 230,000-580,000 minor
    faults per prefill of 128 prompts x 128 tokens (2.9-3.4 s) and others almost none; with the thresholds
    raised, every process took none (2.5-2.7 s; BENCHMARKS.md, "Prefill attention on AMX tiles; page faults
    of in-process steps"). The served engine, which steps on its own thread with THP_MEM_ALLOC_ENABLE,
    showed few faults either way. Raising the mmap and trim thresholds is what ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` (or tcmalloc, which vLLM's CPU docs suggest preloading) would do; the memory
    kept is what one step's activations peak at. ``SLUICE_MALLOC_TUNING=0`` leaves malloc as it is; other C
    libraries are left alone. Returns whether the thresholds are set."""
    global _malloc_tuned
    if _malloc_tuned is not None:
        return _malloc_tuned
    _malloc_tuned = False
    if not switched_on(ENV_MALLOC_TUNING):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # mmap threshold first: setting only the trim threshold turns glibc's dynamic mmap threshold off
        # at its 128 KiB start, and every larger block would be mmap'd.
        _malloc_tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                             and libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))
    except (OSError, AttributeError):
        pass
    if not _malloc_tuned:
        logger.debug("mallopt failed: malloc left with its defaults")
    return _malloc_tuned


class _NullStream:
    """Stands in for a stream on CPU: work runs in issue order on the calling thread."""


class CpuDevice(Device):
    """The host CPU. Streams and events are no-ops: PyTorch ops run synchronously."""

    name = "cpu"

    def __init__(self, num_threads: int | None = None) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        tune_malloc()

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def new_stream(self) -> _NullStream:
        return _NullStream()

    def new_event(self) -> None:
        return None

    def memory_info(self) -> tuple[int, int]:
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info.get("MemAvailable", 0), info.get("MemTotal", 0)

    def attention_backend(self) -> AttentionBackend:
        from engine.attention.torch_backend import TorchAttentionBackend
        from engine.kernels import cpu_paged_decode_attention, cpu_paged_prefill_attention, cpu_write_kv_cache

        return TorchAttentionBackend(decode_kernel=cpu_paged_decode_attention(), kv_writer=cpu_write_kv_cache(),
                                     prefill_kernel=cpu_paged_prefill_attention())

    def prepare_model(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """oneDNN prepacked linears and the CPU kernels (``engine.kernels.prepare_cpu_model``; ``SLUICE_CPU_KERNELS=0``
        keeps F.linear); the memory available now bounds the copies that AMX linears would add."""
        from engine.kernels import prepare_cpu_model

        prepare_cpu_model(model, dtype, memory_available=self.memory_info()[0])

    def row_argmax(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        from engine.kernels import cpu_argmax_rows

        return cpu_argmax_rows()

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed, on transparent huge pages where the kernel has them (``SLUICE_KV_HUGE_PAGES=0``: not).
        Decode attention reads each sequence's blocks, 6 KiB apiece for the default model, scattered over a
        cache of tens of MiB per layer: on 4 KiB pages nearly every block is a TLB miss. On the AMX machine
        (BENCHMARKS.md, "bfloat16 on AMX") cold attention took 14 % less time per layer."""
        cache = torch.empty(shape, dtype=dtype)
        if switched_on(ENV_KV_HUGE_PAGES):
            advise_huge_pages(cache)  # before the first write: zeroing faults the pages in
        return cache.zero_()
