"""compressed-tensors W4A16 checkpoints (llm-compressor's ``W4A16`` scheme, what vLLM runs as
``CompressedTensorsWNA16``): ``quantization_config.quant_method: "compressed-tensors"`` with format
``pack-quantized`` and weights ``{num_bits: 4, type: int, symmetric: true, strategy: group | channel}``, no
activation quantization. Per projection:

* ``weight_packed`` int32 [out, in / 8]: signed codes in [-8, 7] stored plus 8, packed along the input features,
  element ``8j + i`` in bits ``4i`` of word ``j`` (compressed-tensors' ``pack_to_int32``);
* ``weight_scale`` [out, groups] (one column for ``strategy: channel``);
* ``weight_shape`` int [2]: the unpacked [out, in].

``W[n, k] = (weight_packed[n, k] - 8) * weight_scale[n, k // group_size]``. Asymmetric weights (zero points),
activation ordering (``actorder``, ``weight_g_idx``), other bit widths and every other format keep
``engine.models.compressed_tensors``' refusals, named by key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.int4 import Int4Weight, from_groups, unpack_int32

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
_EMPTY: tuple[object, ...] = (None, [], {})
_OFFSET = 8     # signed 4-bit codes are stored plus 8


@dataclass(frozen=True)
class CtW4A16Format:
    """A validated compressed-tensors W4A16 ``quantization_config``."""

    group_size: int          # -1: one group per output channel (strategy channel)

    name = QUANT_METHOD
    suffixes = (".weight_packed", ".weight_scale", ".weight_shape")
    optional = (".weight_zero_point", ".weight_g_idx")

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"groups of {self.group_size}"
        return f"compressed-tensors pack-quantized W4A16, {group}, symmetric"

    def unpack(self, base: str, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        packed, scale, shape = tensors[".weight_packed"], tensors[".weight_scale"], tensors[".weight_shape"]
        codes = unpack_int32(packed, dim=1)
        out, cols = (int(v) for v in shape.tolist())
        if codes.shape[0] != out or codes.shape[1] < cols:
            raise ValueError(f"{base}.weight_packed {tuple(packed.shape)} does not hold the {out} x {cols} weight")
        codes = codes[:, :cols]
        if ".weight_g_idx" in tensors:
            raise ValueError(f"{base}.weight_g_idx: activation ordering (actorder group / weight) is not supported")
        zero_point = tensors.get(".weight_zero_point")
        if zero_point is not None and torch.count_nonzero(zero_point):
            raise ValueError(f"{base}.weight_zero_point: non-zero zero points (asymmetric weights) are not supported")
        groups = 1 if self.group_size == -1 else -(-cols // self.group_size)
        if scale.dim() != 2 or scale.shape != (out, groups):
            raise ValueError(f"{base}.weight_scale {tuple(scale.shape)} is not [{out}, {groups}] ({self.describe()})")
        group_size = cols if groups == 1 else self.group_size
        if cols % group_size:
            raise ValueError(f"{base}: {cols} input features are not whole groups of {group_size}")
        return from_groups(codes, scale.float(), torch.full((out, groups), float(_OFFSET)), group_size, None, base)


def is_w4a16(qc: dict[str, Any]) -> bool:
    """Whether a compressed-tensors ``quantization_config`` packs its weights (``pack-quantized``) anywhere."""
    groups = qc.get("config_groups")
    formats = {qc.get("format")}
    if isinstance(groups, dict):
        formats |= {g.get("format") for g in groups.values() if isinstance(g, dict)}
    return FORMAT in formats


def read_format(qc: dict[str, Any]) -> CtW4A16Format:
    """The W4A16 format of a ``pack-quantized`` ``quantization_config``; ValueError naming the key otherwise."""
    key = "quantization_config"
    for name in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(name) not in _EMPTY:
            raise ValueError(f"{key}.{name} is not supported with {FORMAT} (dense W4A16 weights only)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{key}.quantization_status {status!r} is not supported: expected 'compressed'")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{key}.config_groups: expected at least one group")
    sizes = set()
    for name, group in groups.items():
        where = f"{key}.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != FORMAT:
            raise ValueError(f"{where}.format {fmt!r}: a checkpoint mixing {FORMAT} with other formats is not "
                             "supported")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ValueError(f"{where}.weights is missing")
        for arg, want in (("num_bits", 4), ("type", "int"), ("symmetric", True)):
            if weights.get(arg) != want:
                raise ValueError(f"{where}.weights.{arg} {weights.get(arg)!r} is not supported: Sluice runs "
                                 f"{FORMAT} with 4-bit symmetric int weights (W4A16)")
        if weights.get("dynamic", False) is not False:
            raise ValueError(f"{where}.weights.dynamic {weights.get('dynamic')!r} is not supported")
        if weights.get("actorder") not in (None, "static"):
            raise ValueError(f"{where}.weights.actorder {weights.get('actorder')!r} is not supported")
        strategy = weights.get("strategy")
        if strategy == "group":
            size = weights.get("group_size")
            if size not in (32, 64, 128):
                raise ValueError(f"{where}.weights.group_size {size!r} is not supported: expected 32, 64 or 128")
            sizes.add(size)
        elif strategy == "channel":
            sizes.add(-1)
        else:
            raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported: expected group or channel")
        for other in ("input_activations", "output_activations"):
            if group.get(other) is not None:
                raise ValueError(f"{where}.{other}: quantized activations are not supported with {FORMAT} (W4A16)")
    if len(sizes) != 1:
        raise ValueError(f"{key}.config_groups: groups with different weight strategies are not supported")
    return CtW4A16Format(sizes.pop())
