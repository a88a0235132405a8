"""Native CPU kernels for float32 and bfloat16 models: oneDNN prepacked linears (AMX on CPUs that have it,
for bfloat16), and ``cpu_ops.cpp`` (paged decode attention, RMSNorm with the residual add, SiLU-and-mul,
rotary embedding, the block-quantized linear, which computes in float32, ``amx_linear.cpp``: bfloat16
linears of decode-sized steps on AMX tiles, and ``int8_ops.cpp``: W8A8 int8 linears around oneDNN's int8 GEMM)
compiled on first use with ``torch.utils.cpp_extension`` (g++ and
ninja).

The build lands in torch's extension cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``)
and is reused by every later process; the first engine start on a machine pays for it (about 30 s
on 2 cores). It is compiled with ``-march=native``, so the module name carries a digest of
this CPU's model and flags: a cache shared between different CPUs never loads a build for the wrong
one. When anything fails (no compiler, no ninja), the engine logs why and runs the PyTorch path.

This package is a leaf: it builds and loads the kernels and imports nothing else of the engine. Whether they are
used is decided once per engine by the CPU device from ``KernelSettings`` (``SLUICE_CPU_KERNELS=0`` turns all
of it off, ``SLUICE_AMX_LINEAR=0`` the AMX linears, ``SLUICE_AMX_PREFILL=0`` the prefill attention kernels (AMX
and AVX512-BF16), ``SLUICE_INT8_VNNI=0`` oneDNN's int8 GEMM).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).resolve().parent

class PagedDecodeAttention(Protocol):
    """(query, kv_cache, block_tables, seq_lens, scale[, first_positions]) -> out: ``first_positions`` [N], a
    sliding window's first key of each sequence (the keys before it are neither read nor weighed)."""

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, first_positions: torch.Tensor | None = None) -> torch.Tensor:
        ...


KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (query, kv_cache, block_tables, query_start, seq_lens, scale) -> out
PagedPrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                                 torch.Tensor]

# Model dtypes the CPU kernels take. float16 models run the PyTorch path.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _cpu_digest() -> str:
    """This CPU's model name and feature flags, hashed: what ``-march=native`` compiled for."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        text += "".join(sorted(set(lines)))
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _build(name: str, cflags: list[str]) -> Any:
    from torch.utils.cpp_extension import load

    sources = [str(_SOURCES / name) for name in ("cpu_ops.cpp", "quant_linear.cpp", "amx_linear.cpp", "int8_ops.cpp",
                                                    "int4_ops.cpp")]
    return load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def cpu_ops() -> Any | None:
    """The compiled ``cpu_ops.cpp`` + ``quant_linear.cpp`` + ``amx_linear.cpp`` + ``int8_ops.cpp`` extension
    (``paged_decode_attention``, ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary_``, ``argmax_rows``,
    ``quant_linear``, ``amx_linear``, ``w8a8_linear``, ``int8_quantize_rows``, ``int8_scale_rows``, ``int8_isa``;
    ``int4_ops.cpp``: ``int4_gemv``), or
    None when it cannot be built."""
    try:
        return _build(f"sluice_cpu_ops_{_cpu_digest()}", ["-O3", "-march=native", "-fopenmp"])
    except Exception as e:  # compiler, ninja or headers missing: the PyTorch path still works
        logger.warning("CPU kernels unavailable, using the PyTorch path: %s", e)
        return None


@functools.cache
def avx2_int4_ops() -> Any:
    """``int4_gemv`` (``int4_ops.cpp`` alone) built for AVX2 + FMA without AVX-512 (``-march=x86-64-v3``): the
    portable loops as the compiler vectorizes them for a Zen 2 or Haswell-class CPU, which ``-march=native`` on an
    AVX-512 machine never compiles. For benchmarks (``benchmarks.int4_linear --avx2``); raises when it cannot be
    built."""
    from torch.utils.cpp_extension import load

    return load(name="sluice_int4_avx2", sources=[str(_SOURCES / "int4_module.cpp"), str(_SOURCES / "int4_ops.cpp")],
                extra_cflags=["-O3", "-fopenmp", "-march=x86-64-v3"], extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def portable_cpu_ops() -> Any:
    """The same kernels built for the baseline instruction set (no AVX2/FMA code paths): the loops a CPU
    without AVX2 runs, which ``-march=native`` on this machine would never compile. For tests; raises
    when it cannot be built."""
    flags = ["-O3", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += ["-march=x86-64", "-mno-avx2", "-mno-fma"]
    return _build("sluice_cpu_ops_portable", flags)
