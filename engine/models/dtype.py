"""Parsing the ``--dtype`` setting into a torch dtype."""
from __future__ import annotations

from pathlib import Path

import torch

_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX); without it bf16 matmuls are
    emulated and slower than float32."""
    try:
        flags = cpuinfo.read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """float32/fp32/float, bfloat16/bf16, float16/fp16/half, or "auto": bfloat16 where the device
    runs it natively (float16 on NPU), else float32."""
    key = name.strip().lower()
    if key in _NAMES:
        return _NAMES[key]
    if key != "auto":
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {', '.join(_NAMES)}")
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    if kind == "npu":
        return torch.float16  # every Ascend generation runs fp16; bf16 only from the 910B on
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
