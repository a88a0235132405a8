"""The host CPU as a device: no-op streams, the compiled CPU kernels, huge pages and malloc tuning."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.config import KernelSettings
from engine.device.base import Device
from engine.device.kernel_choice import Int8Path, KernelChoice, default_quant_max_rows
from engine.kernels import KERNEL_DTYPES, cpu_ops

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

# The tile-packed weight copies of amx_linear are made only when they take at most this share of the memory
# available at load time (they double the weights' memory; a large model keeps oneDNN alone).
AMX_LINEAR_MAX_MEMORY_SHARE = 0.25

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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2): blocks up to this size come from the
# heap; the heap gives memory back to the kernel only once 1 GiB at its top is free.
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 1 << 30
_malloc_tuned: bool | None = None


def tune_malloc(enabled: bool = True) -> bool:
    """Keep freed activation memory in the process for the next step (glibc; once per process).

    A CPU step allocates and frees its activations layer by layer: a 2048-token prefill's gate/up output
    alone is 12 MiB. With glibc's defaults such blocks may be mmap'd and unmapped again, or the heap top
    trimmed once a layer's temporaries are freed, and the next step faults the pages in (the kernel zeroing
    each) again. Whether that happens depends on the process's allocation history: measured in-process
    (``LLM.generate`` on the main thread, bfloat16 on 2 cores), some processes took 230,000-580,000 minor
    faults per prefill of 128 prompts x 128 tokens (2.9-3.4 s) and others almost none; with the thresholds
    raised, every process took none (2.5-2.7 s; docs/cpu-kernels.md, "malloc thresholds"). The served engine,
    which steps on its own thread with THP_MEM_ALLOC_ENABLE, showed few faults either way. Raising the mmap
    and trim thresholds is what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (or tcmalloc, which
    vLLM's CPU docs suggest preloading) would do; the memory kept is what one step's activations peak at.
    ``enabled=False`` (``KernelSettings.malloc_tuning``, ``SLUICE_MALLOC_TUNING=0``) leaves malloc as it is;
    other C libraries are left alone. Returns whether the thresholds are set."""
    global _malloc_tuned
    if _malloc_tuned is not None:
        return _malloc_tuned
    if not enabled:
        return False
    _malloc_tuned = False
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

    def __init__(self, num_threads: int | None = None, kernels: KernelSettings | None = None) -> None:
        self.kernels = KernelSettings.from_env() if kernels is None else kernels
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.malloc_tuned = tune_malloc(self.kernels.malloc_tuning)
        self._int8_warned = False

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

    def ops(self) -> Any | None:
        """The compiled CPU kernels, unless switched off (``KernelSettings.cpu_kernels``) or unbuildable."""
        return cpu_ops() if self.kernels.cpu_kernels else None

    def attention_backend(self) -> AttentionBackend:
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(self.ops(), prefill_kernel=self.kernels.amx_prefill)

    def kernel_choice(self, dtype: torch.dtype, amx_pack_bytes: int = 0, int8_layers: int = 0) -> KernelChoice:
        """float32 and bfloat16 models: oneDNN prepacked linears (when torch has it) and the compiled kernels (when
        they build): fused norms and activations, in-place rotary, linears on the checkpoint's GGUF blocks (every
        step of a float32 model, the smallest steps of a bfloat16 one), and on CPUs with AMX bfloat16 decode-sized
        linears on tile-packed copies, when those take at most ``AMX_LINEAR_MAX_MEMORY_SHARE`` of the memory
        available now; W8A8 layers (when the model has ``int8_layers``) on oneDNN's int8 GEMM where the CPU has VNNI
        (``int8_path``). float16 models (and
        ``cpu_kernels`` off) run PyTorch's ops (W8A8 layers: the portable path)."""
        if dtype not in KERNEL_DTYPES or not self.kernels.cpu_kernels:
            return KernelChoice.torch()
        ops = self.ops()
        amx = (ops is not None and dtype == torch.bfloat16 and self.kernels.amx_linear and ops.has_amx_linear())
        if amx and amx_pack_bytes > AMX_LINEAR_MAX_MEMORY_SHARE * self.memory_info()[0]:
            logger.info("amx_linear off: its weight copies (%.0f MiB) would take more than %.0f%% of the memory "
                        "available; decode steps' linears stay on oneDNN", amx_pack_bytes / 2**20,
                        100 * AMX_LINEAR_MAX_MEMORY_SHARE)
            amx = False
        onednn = torch.backends.mkldnn.is_available()
        return KernelChoice(ops=ops, onednn=onednn,
                            quant_max_rows=default_quant_max_rows(dtype, self.kernels.quant_max_rows),
                            amx_linear=amx, int8=self.int8_path(ops, onednn) if int8_layers else "portable")

    def int8_path(self, ops: Any | None, onednn: bool) -> Int8Path:
        """oneDNN's int8 GEMM for W8A8 layers where this CPU has int8 dot products (AVX512-VNNI, AVX-VNNI or
        AMX-INT8; without them its u8 x s8 pair sums saturate in int16) and the switch is on
        (``KernelSettings.int8_vnni``); else the portable path, with one warning per device saying why."""
        isa = ops.int8_isa() if ops is not None else ""
        if ops is not None and onednn and isa and self.kernels.int8_vnni:
            return "onednn"
        if not self._int8_warned:
            self._int8_warned = True
            if not self.kernels.int8_vnni:
                why = "SLUICE_INT8_VNNI=0 (KernelSettings.int8_vnni off)"
            elif ops is None or not onednn:
                why = "the compiled CPU kernels or oneDNN are unavailable"
            else:
                why = "this CPU has no AVX512-VNNI, AVX-VNNI or AMX-INT8"
            logger.warning("W8A8 int8 linears: %s; they run the portable path (exact float32 GEMMs of the int8 codes), "
                           "slower than oneDNN's int8 GEMM", why)
        return "portable"

    def row_argmax(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        ops = self.ops()
        return None if ops is None else ops.argmax_rows

    def empty_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """On transparent huge pages where the kernel has them (``KernelSettings.kv_huge_pages``). Decode attention
        reads each sequence's blocks, 6 KiB apiece for the default model, scattered over a cache of tens of MiB per
        layer: on 4 KiB pages nearly every block is a TLB miss. On the AMX machine cold attention took 14 % less
        time per layer (docs/cpu-kernels.md)."""
        cache = torch.empty(shape, dtype=dtype)
        if self.kernels.kv_huge_pages:
            advise_huge_pages(cache)  # before the first write: zeroing faults the pages in
        return cache
