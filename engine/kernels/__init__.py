"""Native CPU kernels for float32 and bfloat16 models: oneDNN prepacked linears (AMX on CPUs that have it,
for bfloat16), and ``cpu_ops.cpp`` (paged decode attention, RMSNorm with the residual add, SiLU-and-mul,
rotary embedding, the block-quantized linear, which computes in float32, and ``amx_linear.cpp``: bfloat16
linears of decode-sized steps on AMX tiles) compiled on first use with ``torch.utils.cpp_extension`` (g++ and
ninja).

The build lands in torch's extension cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``)
and is reused by every later process; the first engine start on a machine pays for it (about 30 s
on 2 cores). It is compiled with ``-march=native``, so the module name carries a digest of
this CPU's model and flags: a cache shared between different CPUs never loads a build for the wrong
one. When anything fails (no compiler, no ninja), the engine logs why and runs the PyTorch path.

``SLUICE_CPU_KERNELS=0`` turns all of it off (``F.linear``, PyTorch element-wise ops, gather + SDPA), for
comparison or when a kernel misbehaves on some CPU; ``1`` (the default) uses them when available.
``SLUICE_AMX_LINEAR=0`` keeps bfloat16 decode steps' linears on oneDNN (and saves the tile-packed weight copy).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.env import switched_on

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).resolve().parent
ENV_CPU_KERNELS = "SLUICE_CPU_KERNELS"
ENV_AMX_PREFILL = "SLUICE_AMX_PREFILL"
# Off: bfloat16 decode-sized linears stay on oneDNN and no tile-packed weight copies are made.
ENV_AMX_LINEAR = "SLUICE_AMX_LINEAR"

PagedDecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (query, kv_cache, block_tables, query_start, seq_lens, scale) -> out
PagedPrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                                 torch.Tensor]


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


def cpu_kernels_enabled() -> bool:
    """False when ``SLUICE_CPU_KERNELS`` is 0 / false / no / off."""
    return switched_on(ENV_CPU_KERNELS)


# Model dtypes the CPU kernels take. float16 models run the PyTorch path.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# The tile-packed weight copies of amx_linear are made only when they take at most this share of the memory
# available at load time (they double the weights' memory; a large model keeps oneDNN alone).
AMX_LINEAR_MAX_MEMORY_SHARE = 0.25


def prepare_cpu_model(model: torch.nn.Module, dtype: torch.dtype, memory_available: int | None = None) -> bool:
    """float32 and bfloat16 models: prepack the linears for oneDNN (when torch has it) and hand the model
    the fused elementwise ops and paged decode attention (when ``cpu_ops`` builds); float32 models also
    the quantized linear. True when anything changed.

    bfloat16 linears run oneDNN's bfloat16 GEMM, which uses AMX tiles or AVX512-BF16 where the CPU has
    them (``--dtype auto`` picks bfloat16 only there), except small steps: on AMX CPUs steps of up to
    ``AMX_LINEAR_MAX_ROWS`` rows run ``amx_linear`` (whose weight copies replace the quantized blocks), elsewhere
    steps of up to ``quant_max_rows`` rows read the checkpoint's quantized blocks."""
    from engine.models.llama import quant_max_rows

    ops = cpu_ops() if dtype in KERNEL_DTYPES and cpu_kernels_enabled() else None
    if ops is None and hasattr(model, "drop_quantized"):
        model.drop_quantized()  # nothing here reads the block-quantized copies
    if dtype not in KERNEL_DTYPES or not cpu_kernels_enabled():
        return False
    changed = False
    if ops is not None and hasattr(model, "use_cpu_ops"):  # first: layers that will only read blocks free
        model.use_cpu_ops(ops)                              # their float32 weights instead of packing them
        changed = True
    if torch.backends.mkldnn.is_available() and hasattr(model, "pack_onednn"):
        model.pack_onednn()
        changed = True
    if (ops is not None and dtype == torch.bfloat16 and hasattr(model, "pack_amx") and switched_on(ENV_AMX_LINEAR)
            and ops.has_amx_linear()):
        from engine.models.llama import AMX_LINEAR_MAX_ROWS

        need = model.amx_pack_bytes()
        if memory_available is not None and need > AMX_LINEAR_MAX_MEMORY_SHARE * memory_available:
            logger.info("amx_linear off: its weight copies (%.0f MiB) would take more than %.0f%% of the %.0f MiB "
                        "available; decode steps' linears stay on oneDNN", need / 2**20,
                        100 * AMX_LINEAR_MAX_MEMORY_SHARE, memory_available / 2**20)
        else:
            logger.info("%d projections run steps of <= %d rows on AMX tiles (amx_linear; %.0f MiB of weight copies)",
                        model.pack_amx(ops), AMX_LINEAR_MAX_ROWS, need / 2**20)
    if ops is not None and getattr(model, "quantized_linears", 0):
        rows = quant_max_rows(dtype)
        limit = "every step" if rows is None else f"steps of <= {rows} rows"
        logger.info("%d projections run from the checkpoint's quantized blocks (%s)", model.quantized_linears, limit)
    return changed


def _build(name: str, cflags: list[str]) -> Any:
    from torch.utils.cpp_extension import load

    sources = [str(_SOURCES / name) for name in ("cpu_ops.cpp", "quant_linear.cpp", "amx_linear.cpp")]
    return load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def cpu_ops() -> Any | None:
    """The compiled ``cpu_ops.cpp`` + ``quant_linear.cpp`` + ``amx_linear.cpp`` extension (``paged_decode_attention``,
    ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary_``, ``argmax_rows``, ``quant_linear``, ``amx_linear``),
    or None when CPU kernels are turned off or it cannot be built."""
    if not cpu_kernels_enabled():
        return None
    try:
        return _build(f"sluice_cpu_ops_{_cpu_digest()}", ["-O3", "-march=native", "-fopenmp"])
    except Exception as e:  # compiler, ninja or headers missing: the PyTorch path still works
        logger.warning("CPU kernels unavailable, using the PyTorch path: %s", e)
        return None


@functools.cache
def portable_cpu_ops() -> Any:
    """The same kernels built for the baseline instruction set (no AVX2/FMA code paths): the loops a CPU
    without AVX2 runs, which ``-march=native`` on this machine would never compile. For tests; raises
    when it cannot be built."""
    flags = ["-O3", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += ["-march=x86-64", "-mno-avx2", "-mno-fma"]
    return _build("sluice_cpu_ops_portable", flags)


def cpu_argmax_rows() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``argmax_rows(x)`` from ``cpu_ops``: ``torch.argmax(x, -1)`` of float32 or bfloat16 rows, vectorised; or None."""
    ops = cpu_ops()
    return None if ops is None else ops.argmax_rows


def cpu_write_kv_cache() -> KVWriter | None:
    """``write_kv_cache(key, value, kv_cache, slot_mapping)`` from ``cpu_ops`` (row copies; the cache's own dtype,
    each token's rows contiguous), or None."""
    ops = cpu_ops()
    return None if ops is None else ops.write_kv_cache


def cpu_paged_decode_attention() -> PagedDecodeAttention | None:
    """``paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale)`` from ``cpu_ops``, or None."""
    ops = cpu_ops()
    return None if ops is None else ops.paged_decode_attention


def cpu_paged_prefill_attention() -> PagedPrefillAttention | None:
    """``paged_prefill_attention(query, kv_cache, block_tables, query_start, seq_lens, scale)`` from ``cpu_ops``
    where this CPU runs it (AMX tiles: bfloat16 query and cache, block_size % 16 == 0, head_dim a multiple of
    32 up to 128), or None. ``SLUICE_AMX_PREFILL=0``: None (the SDPA paths)."""
    if not switched_on(ENV_AMX_PREFILL):
        return None
    ops = cpu_ops()
    return None if ops is None or not ops.has_amx_attention() else ops.paged_prefill_attention
