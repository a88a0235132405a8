"""Every ``SLUICE_*`` environment variable Sluice reads is read here, and nowhere else.

Each one is a documented fallback of a setting that also has a home in a settings object or a flag:

====================  =============================================  ==========================================
variable              meaning                                        the setting it falls back for
====================  =============================================  ==========================================
SLUICE_CPU_KERNELS    0: no compiled kernels, no oneDNN packing      ``engine.config.KernelSettings.cpu_kernels``
SLUICE_AMX_LINEAR     0: bfloat16 decode linears stay on oneDNN      ``KernelSettings.amx_linear``
SLUICE_AMX_PREFILL    0: SDPA, no prefill kernel (AMX/AVX512-BF16)   ``KernelSettings.amx_prefill``
SLUICE_QUANT_MAX_ROWS most rows a step runs on GGUF blocks           ``KernelSettings.quant_max_rows``
SLUICE_KV_HUGE_PAGES  0: no MADV_HUGEPAGE on the CPU KV cache         ``KernelSettings.kv_huge_pages``
SLUICE_MALLOC_TUNING  0: glibc's malloc thresholds left alone        ``KernelSettings.malloc_tuning``
SLUICE_INT8_VNNI      0: W8A8 layers run the portable int8 path      ``KernelSettings.int8_vnni``
SLUICE_API_KEY        the bearer key the REST API requires           ``--api-key``
SLUICE_PARENT_PID     set by ``sluice serve`` for its children only  (process plumbing, not user-facing)
====================  =============================================  ==========================================

Variables with vLLM's names, so that a deployment written for vLLM carries over:

================================  ===================================  ===========================================
VLLM_ALLOW_RUNTIME_LORA_UPDATING  true: clients may load LoRA adapters  ``--allow-runtime-lora-updating``
VLLM_API_KEY                      the bearer key, when SLUICE_API_KEY   ``--api-key``
                                  is not set
================================  ===================================  ===========================================
"""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

ENV_API_KEY = "SLUICE_API_KEY"
ENV_VLLM_API_KEY = "VLLM_API_KEY"
ENV_PARENT_PID = "SLUICE_PARENT_PID"
ENV_RUNTIME_LORA_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_OFF = ("0", "false", "no", "off")


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def switched_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """False when ``name`` is 0 / false / no / off (any case, spaces ignored); True when unset or anything else:
    every switch defaults to on."""
    return _environ(environ).get(name, "1").strip().lower() not in _OFF


def row_limit(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """A non-negative integer, or None when unset or empty. Raises ValueError naming the variable."""
    text = _environ(environ).get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
    return value


def kernel_switches(environ: Mapping[str, str] | None = None) -> dict[str, bool | int | None]:
    """The CPU kernel switches, named as ``KernelSettings``' fields."""
    return {"cpu_kernels": switched_on("SLUICE_CPU_KERNELS", environ),
            "amx_linear": switched_on("SLUICE_AMX_LINEAR", environ),
            "amx_prefill": switched_on("SLUICE_AMX_PREFILL", environ),
            "quant_max_rows": row_limit("SLUICE_QUANT_MAX_ROWS", environ),
            "kv_huge_pages": switched_on("SLUICE_KV_HUGE_PAGES", environ),
            "malloc_tuning": switched_on("SLUICE_MALLOC_TUNING", environ),
            "int8_vnni": switched_on("SLUICE_INT8_VNNI", environ)}


def runtime_lora_updating(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` as vLLM reads it: on for 1 or true (any case), off otherwise."""
    return _environ(environ).get(ENV_RUNTIME_LORA_UPDATING, "0").strip().lower() in ("1", "true")


def api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """``SLUICE_API_KEY``, else vLLM's ``VLLM_API_KEY``; None when neither is set (or both are empty)."""
    env = _environ(environ)
    return env.get(ENV_API_KEY) or env.get(ENV_VLLM_API_KEY) or None


def take_parent_pid(environ: MutableMapping[str, str] | None = None) -> int | None:
    """The pid ``sluice serve`` passed to this child, removed from the environment (grandchildren must not
    inherit it); None when this process was not started by it."""
    env = os.environ if environ is None else environ
    value = env.pop(ENV_PARENT_PID, None)
    return None if value is None else int(value)
