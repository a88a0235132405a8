"""AWQ checkpoints (AutoAWQ's GEMM packing, what vLLM reads as ``awq``): a Hugging Face directory whose config.json
has a ``quantization_config`` with ``quant_method: "awq"``, ``bits: 4``, ``zero_point: true``, ``version: "gemm"``
and ``group_size`` 32 to 128 (or -1: one group per output channel). Per projection, AutoAWQ's ``WQLinear_GEMM``:

* ``qweight`` int32 [in, out / 8]: 8 codes packed along the output features in AWQ's order: nibble ``i`` (bits
  ``4i``) of word ``j`` holds output feature ``8j + [0, 2, 4, 6, 1, 3, 5, 7][i]``;
* ``qzeros`` int32 [groups, out / 8]: zero points packed the same way, stored as they are;
* ``scales`` float16 [groups, out];

``W[n, k] = scales[k // group_size, n] * (qweight[k, n] - zero[k // group_size, n])``. Modules in
``modules_to_not_convert`` are stored as floats and load as such. Refused by name: ``version`` ``gemv``,
``gemv_fast``, ``marlin``, ``exllama``, ``ipex`` (other packings), ``zero_point: false``, other bit widths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.int4 import Int4Weight, from_groups, unpack_int32

QUANT_METHOD = "awq"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP_SIZES = (32, 64, 128, -1)


@dataclass(frozen=True)
class AwqFormat:
    """A validated AWQ GEMM ``quantization_config``."""

    group_size: int          # -1: one group per output channel

    name = QUANT_METHOD
    suffixes = (".qweight", ".qzeros", ".scales")
    optional: tuple[str, ...] = ()

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"AWQ GEMM 4-bit, {group}, with zero points"

    def unpack(self, base: str, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        qweight, qzeros, scales = tensors[".qweight"], tensors[".qzeros"], tensors[".scales"]
        codes = unpack_int32(qweight, dim=1, order=AWQ_ORDER).t()   # [out, in]
        out, cols = codes.shape
        zeros = unpack_int32(qzeros, dim=1, order=AWQ_ORDER)        # [groups, out]
        groups = 1 if self.group_size == -1 else -(-cols // self.group_size)
        if scales.shape != (groups, out) or zeros.shape != (groups, out):
            raise ValueError(f"{base}: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not hold "
                             f"{groups} groups of the [{out}, {cols}] weight ({self.describe()})")
        group_size = cols if groups == 1 else self.group_size
        if cols % group_size:
            raise ValueError(f"{base}: {cols} input features are not whole groups of {group_size}")
        return from_groups(codes, scales.float().t(), zeros.float().t(), group_size, None, base)


def read_format(qc: dict[str, Any]) -> AwqFormat:
    """The AWQ format of a ``quantization_config``; ValueError naming the key for what is not read."""
    key = "quantization_config"
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{key}.bits {bits!r} is not supported: Sluice runs 4-bit AWQ only")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{key}.version {version!r} is not supported: Sluice reads AWQ's GEMM packing "
                         "(version 'gemm')")
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{key}.zero_point {qc.get('zero_point')!r} is not supported: expected true")
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{key}.group_size {group_size!r} is not supported: expected 32, 64, 128 or -1 "
                         "(per channel)")
    return AwqFormat(group_size)
