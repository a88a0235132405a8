"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum; what vLLM reads as ``gptq``): a Hugging Face directory whose
config.json has a ``quantization_config`` with ``quant_method: "gptq"``.

Read: ``bits: 4``; ``group_size`` 32 to 128, or -1 (one group per output channel); ``desc_act`` (act order: each input
channel's group is in ``g_idx``); ``sym`` true or false; ``checkpoint_format`` ``"gptq"`` (v1, AutoGPTQ's: a zero
point is stored minus 1, so the kernels add 1 back, as vLLM's and AutoGPTQ's do) or ``"gptq_v2"`` (GPTQModel's:
stored as it is). Per projection, AutoGPTQ's ``QuantLinear`` layout:

* ``qweight`` int32 [in / 8, out]: 8 codes packed along the input features, row ``8i + j`` in bits ``4j``;
* ``qzeros`` int32 [groups, out / 8]: zero points packed along the output features the same way;
* ``scales`` float16 [groups, out];
* ``g_idx`` int32 [in]: each input feature's group (``k // group_size`` without act order);
* ``bias`` as a float model stores it.

``W[n, k] = scales[g_idx[k], n] * (qweight[k, n] - zero[g_idx[k], n])``. Refused, naming the key: other bit widths,
other group sizes, other checkpoint formats (``marlin``, ``bitblas``), per-module overrides (GPTQModel's
``dynamic``), a pack dtype other than int32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.int4 import Int4Weight, from_groups, unpack_int32

QUANT_METHOD = "gptq"
V1, V2 = "gptq", "gptq_v2"
GROUP_SIZES = (32, 64, 128, -1)


@dataclass(frozen=True)
class GptqFormat:
    """A validated GPTQ ``quantization_config``."""

    group_size: int          # -1: one group per output channel
    desc_act: bool
    sym: bool
    v2: bool                 # zero points stored as they are (else stored minus 1)

    name = QUANT_METHOD
    suffixes = (".qweight", ".qzeros", ".scales")
    optional = (".g_idx",)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"groups of {self.group_size}"
        return (f"GPTQ {'v2' if self.v2 else 'v1'} 4-bit, {group}, {'symmetric' if self.sym else 'asymmetric'}"
                + (", act order" if self.desc_act else ""))

    def unpack(self, base: str, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        qweight, qzeros, scales = tensors[".qweight"], tensors[".qzeros"], tensors[".scales"]
        codes = unpack_int32(qweight, dim=0).t()            # [out, in]
        out, cols = codes.shape
        zeros = unpack_int32(qzeros, dim=1).to(torch.int32)  # [groups, out]
        if not self.v2:
            zeros = zeros + 1
        groups = 1 if self.group_size == -1 else -(-cols // self.group_size)
        if scales.shape != (groups, out) or zeros.shape != (groups, out):
            raise ValueError(f"{base}: scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} do not hold "
                             f"{groups} groups of the [{out}, {cols}] weight ({self.describe()})")
        group_size = cols if groups == 1 else self.group_size
        if cols % group_size:
            raise ValueError(f"{base}: {cols} input features are not whole groups of {group_size}")
        g_idx = tensors.get(".g_idx")
        if g_idx is not None and groups == 1:
            g_idx = None     # one group: every column's is 0
        return from_groups(codes, scales.float().t(), zeros.float().t(), group_size, g_idx, base)


def read_format(qc: dict[str, Any]) -> GptqFormat:
    """The GPTQ format of a ``quantization_config``; ValueError naming the key for what is not read."""
    key = "quantization_config"
    bits = qc.get("bits")
    if bits != 4:
        raise ValueError(f"{key}.bits {bits!r} is not supported: Sluice runs 4-bit GPTQ only "
                         f"({bits}-bit GPTQ is refused)")
    group_size = qc.get("group_size", 128)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{key}.group_size {group_size!r} is not supported: expected 32, 64, 128 or -1 "
                         "(per channel)")
    fmt = qc.get("checkpoint_format", qc.get("format", V1))
    if fmt not in (V1, V2):
        raise ValueError(f"{key}.checkpoint_format {fmt!r} is not supported: expected {V1!r} or {V2!r}")
    if qc.get("dynamic") not in (None, {}):
        raise ValueError(f"{key}.dynamic (per-module overrides) is not supported")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ValueError(f"{key}.pack_dtype {qc.get('pack_dtype')!r} is not supported: expected int32")
    return GptqFormat(group_size, bool(qc.get("desc_act", False)), bool(qc.get("sym", True)), fmt == V2)
