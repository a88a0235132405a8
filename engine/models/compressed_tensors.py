"""compressed-tensors W8A8 int8 checkpoints (what llm-compressor writes and vLLM reads): a Hugging Face directory
whose config.json has a ``quantization_config`` with ``quant_method: "compressed-tensors"``.

The one scheme read is W8A8 int8 as vLLM's ``CompressedTensorsW8A8Int8`` runs it dynamically: weights
``{num_bits: 8, type: int, symmetric: true, strategy: channel}``, input activations ``{num_bits: 8, type: int,
symmetric: true, dynamic: true, strategy: token}``, format ``int-quantized`` (or ``naive-quantized``, which stores
8-bit int weights the same way). Each quantized projection stores ``<proj>.weight`` (int8 [out, in]) and
``<proj>.weight_scale`` (float [out, 1]); a symmetric checkpoint may also carry an all-zero
``<proj>.weight_zero_point``. Projections the config ``ignore``s (the lm_head, typically) are stored as floats and
load as they are. Anything else (static activation scales, asymmetric, group or block strategies, 4-bit, fp8,
sparsity, quantized KV caches) is refused, naming the key.

The int8 codes and scales are kept exactly (``Int8Weight``); the model's dense weight is loaded too, dequantized
(``codes * scale`` in the model's dtype), so the usual shape checks and sharding apply; it is freed when the layers
pick their methods. A tensor-parallel rank reads its shard: column-parallel projections take their rows of the
weight and of the scale, row-parallel ones their columns of the weight and every scale.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.models.sharding import WHOLE, Shard
from engine.models.w8a8 import Int8Weight

QUANT_METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized")
_SCALE = ".weight_scale"
_ZERO_POINT = ".weight_zero_point"
# Tensors of schemes Sluice does not run: static activation scales, group indices, packed 4-bit weights.
_REFUSED_SUFFIXES = (".input_scale", ".input_zero_point", ".weight_g_idx", ".weight_packed", ".weight_shape")

_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
_EMPTY: tuple[object, ...] = (None, [], {})   # unset optional keys


@dataclass(frozen=True)
class W8A8Scheme:
    """A validated compressed-tensors W8A8 int8 ``quantization_config``: which modules stay float (``ignore``: names
    or ``re:`` patterns, as compressed-tensors writes them)."""

    ignore: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module) is not None:
                    return True
            elif entry == module or module.endswith("." + entry):
                return True
        return False


def read_scheme(config: dict[str, Any]) -> W8A8Scheme | None:
    """The W8A8 scheme of a config.json, or None when it has no ``quantization_config``. Raises ValueError naming the
    key for a quantization Sluice does not run."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    key = "quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{key} must be an object")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"{key}.quant_method {method!r} is not supported: Sluice reads {QUANT_METHOD} W8A8 int8 "
                         "checkpoints (or quantizes float ones itself with --quantization w8a8)")
    for name in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(name) not in _EMPTY:
            raise ValueError(f"{key}.{name} is not supported (Sluice reads dense W8A8 int8 weights and keeps its KV "
                             "cache in the model's dtype)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{key}.quantization_status {status!r} is not supported: expected 'compressed' (int8 "
                         "weights stored as int8)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{key}.config_groups: expected at least one group")
    for name, group in groups.items():
        where = f"{key}.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt not in FORMATS:
            raise ValueError(f"{where}.format {fmt!r} is not supported: Sluice reads {' or '.join(FORMATS)} "
                             "(int8 weights)")
        _check_args(group.get("weights"), _WEIGHTS, f"{where}.weights")
        if group.get("input_activations") is None:
            raise ValueError(f"{where}.input_activations is missing: weight-only int8 (W8A16) is not supported, "
                             "only W8A8 with dynamic per-token activations")
        _check_args(group.get("input_activations"), _INPUTS, f"{where}.input_activations")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations: quantized outputs are not supported")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise ValueError(f"{key}.ignore must be a list of module names")
    return W8A8Scheme(tuple(ignore))


def _check_args(args: Any, expected: dict[str, object], where: str) -> None:
    if not isinstance(args, dict):
        raise ValueError(f"{where} is missing: expected {expected}")
    for name, want in expected.items():
        got = args.get(name, False if name == "dynamic" else None)
        if got != want:
            raise ValueError(f"{where}.{name} {got!r} is not supported: Sluice runs W8A8 int8 with weights "
                             f"{_describe(_WEIGHTS)} and activations {_describe(_INPUTS)}")
    for name in ("group_size", "block_structure"):
        if args.get(name) not in _EMPTY:
            raise ValueError(f"{where}.{name} {args[name]!r} is not supported: per-channel weights and per-token "
                             "activations only")


def _describe(args: dict[str, object]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in args.items()) + "}"


def check_tensor_names(names: Iterable[str]) -> None:
    """Refuses, naming the tensor, a checkpoint carrying tensors of a scheme that is not run (static activation
    scales, group indices, packed weights) even where its config did not say so."""
    for name in names:
        if name.endswith(_REFUSED_SUFFIXES):
            raise ValueError(f"checkpoint tensor {name!r} belongs to a compressed-tensors scheme Sluice does not run "
                             "(W8A8 int8 with dynamic per-token activations only)")


def shard_of(weight_shard: Callable[[str], Shard | None]) -> Callable[[str], Shard | None]:
    """The shard function of a W8A8 checkpoint's tensors from the model's: a weight's scale and zero point follow its
    rows (a column-parallel shard), or are whole (a row-parallel one, whose shard is columns)."""
    def shard(name: str) -> Shard | None:
        for suffix in (_SCALE, _ZERO_POINT):
            if name.endswith(suffix):
                weight = weight_shard(name.removesuffix(suffix) + ".weight")
                if weight is None:
                    return None
                return weight if weight.dim == 0 else WHOLE
        return weight_shard(name)

    return shard


def split_int8(tensors: Iterable[tuple[str, torch.Tensor]], scheme: W8A8Scheme, dtype: torch.dtype,
               int8: list[tuple[str, Int8Weight]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model's float ones (``<proj>.weight`` dequantized to ``dtype``, scales and
    zero points consumed), appending each quantized projection's exact ``(name, Int8Weight)`` to ``int8`` as its
    weight and scale both arrive. Raises ValueError naming the tensor for a weight without its scale (or the
    reverse), a non-zero zero point, or an int8 weight of a module the scheme ignores."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(_ZERO_POINT):
            if torch.count_nonzero(tensor):
                raise ValueError(f"{name}: non-zero zero points (asymmetric weights) are not supported")
            continue
        if name.endswith(_SCALE):
            base = name.removesuffix(_SCALE)
            scales[base] = tensor
        elif name.endswith(".weight") and tensor.dtype == torch.int8:
            base = name.removesuffix(".weight")
            if scheme.ignores(base):
                raise ValueError(f"{name} is int8 but quantization_config.ignore lists {base!r} as unquantized")
            codes[base] = tensor
        else:
            yield name, tensor
            continue
        if base in codes and base in scales:
            q, s = codes.pop(base), scales.pop(base)
            weight = _int8_weight(base, q, s)
            int8.append((base + ".weight", weight))
            yield base + ".weight", weight.dequantize().to(dtype)
    for base in (*codes, *scales):
        missing = f"{base}{_SCALE}" if base in codes else f"{base}.weight (int8)"
        raise ValueError(f"compressed-tensors checkpoint: {missing} is missing")


def _int8_weight(base: str, q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    if scale.numel() != q.shape[0] or (scale.dim() == 2 and scale.shape[1] != 1) or scale.dim() > 2:
        raise ValueError(f"{base}{_SCALE}: shape {tuple(scale.shape)} is not one scale per output channel of the "
                         f"[{q.shape[0]}, {q.shape[1]}] weight (strategy channel)")
    return Int8Weight(q.contiguous(), scale.reshape(-1).float().contiguous())
