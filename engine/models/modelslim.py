"""msModelSlim checkpoints (Ascend's quantization tool) as vLLM-Ascend loads them (``--quantization ascend``): a
Hugging Face directory with a ``quant_model_description.json`` beside its safetensors, mapping every tensor name to
its quantization type (``"model.layers.0.self_attn.q_proj.weight": "W8A8"``), plus model-level keys
(``model_quant_type``, ``version``, ``group_size``, ``metadata``, ``optional``, and the KV cache / attention
quantization keys). vLLM-Ascend: ``vllm_ascend/quantization/modelslim_config.py`` (the description, fused layers'
types) and ``methods/w8a8_static.py`` / ``methods/w8a8_dynamic.py`` (the tensors each type registers); msModelSlim's
writer: ``msmodelslim/core/quant_service/modelslim_v1/save/ascendv1.py``.

Read here, per linear (a projection or the lm_head):

* ``FLOAT``: its float ``weight`` (and ``bias``), loaded as they are.
* ``W8A8`` (static activations, ``engine.models.w8a8_static``): ``weight`` int8 [out, in], ``input_scale`` and
  ``input_offset`` (one each: float32 [1] in msModelSlim's current writer; the offset a whole number),
  ``deq_scale`` [out] (float32 when the model was bfloat16, else int64 holding the float32's bits: msModelSlim's
  ``deqscale2int64``) and ``quant_bias`` int32 [out] (the float bias folded in, so the file's float ``bias`` copy is
  not added again). ``weight_scale`` / ``weight_offset`` of this type are not read (vLLM-Ascend's W8A8 method does
  not use them).
* ``W8A8_DYNAMIC`` (per-token activations, ``engine.models.w8a8``): ``weight`` int8 [out, in], ``weight_scale``
  [out, 1] and an all-zero ``weight_offset`` [out, 1] (symmetric weights: a non-zero offset is refused; vLLM-Ascend
  would ignore it), the float ``bias`` added as usual.

The parts of a fused projection (q/k/v, gate/up) must share one type (vLLM-Ascend refuses a mix too) and, when
static, one input scale and offset: they read one input, and msModelSlim calibrates it once (vLLM-Ascend keeps the
last part's without checking; Sluice refuses parts that differ). Every other type (``W4A8_DYNAMIC``, ``W8A16``,
``W4A16``, ``W8A8_MIX``, ``W8A8S`` / ``W8A8SC`` sparse, ``W16A16S``, the MX and FP8 types, ``W4A4_*``), quantized KV
caches or attention (``kv_cache_type``, ``fa_quant_type``, ``indexer_quant_type``), per-group weight scales
(``group_size``), anti-outlier norm biases (``*norm.bias``, ``*.module.weight``), projections fused in the file and
static experts are refused at load, naming the type or the tensor, before any weight is read.

As for compressed-tensors, the codes and scales are kept exactly and the dense weight is loaded too, dequantized,
for the usual shape checks and sharding, and freed when the layers pick their methods. A tensor-parallel rank reads
its shard: a column-parallel projection its rows of the weight and of every per-channel tensor, a row-parallel one
its columns of the weight and all of the rest, with a zero ``quant_bias`` on every rank but the first (the ranks'
sums are added up, and the bias must come in once: vLLM-Ascend passes ``bias=None`` on those ranks).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers.linear import Linear
from engine.models.sharding import EXPERT, WHOLE, Shard
from engine.models.w8a8 import Int8Weight
from engine.models.w8a8_static import AnyInt8Weight, StaticInt8Weight
from engine.models.weight_names import map_name

DESCRIPTION = "quant_model_description.json"
STATIC, DYNAMIC, FLOAT = "W8A8", "W8A8_DYNAMIC", "FLOAT"
_RUNS = f"Sluice runs {STATIC} (static) and {DYNAMIC} linears and {FLOAT} tensors"

# The tensors each type reads beside ``weight``: (required, optional when present).
_PARTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    STATIC: ((".input_scale", ".input_offset", ".deq_scale", ".quant_bias"), ()),
    DYNAMIC: ((".weight_scale",), (".weight_offset",)),
}
_PER_CHANNEL = (".weight_scale", ".weight_offset", ".deq_scale", ".quant_bias")
_PER_TENSOR = (".input_scale", ".input_offset")
# Model-level keys that quantize the KV cache or attention.
_REFUSED_KEYS = ("kv_cache_type", "kv_quant_type", "fa_quant_type", "indexer_quant_type")
_UNSET: tuple[object, ...] = (None, "", 0, {}, [])


@dataclass(frozen=True)
class ModelSlimScheme:
    """A validated description: each quantized linear (its name without ``.weight``) -> its type, and the tensors
    of it to read (suffixes, ``.weight`` included)."""

    types: dict[str, str]
    parts: dict[str, frozenset[str]]


def has_description(directory: Path) -> bool:
    return (directory / DESCRIPTION).is_file()


def read_scheme(directory: Path, names: Iterable[str], config: ModelConfig) -> ModelSlimScheme | None:
    """The scheme of ``directory``'s description, None without one. ``names``: every tensor of the checkpoint.
    Raises ValueError naming the type, key or tensor for what Sluice does not run."""
    path = directory / DESCRIPTION
    if not path.is_file():
        return None
    description = json.loads(path.read_text())
    if not isinstance(description, dict):
        raise ValueError(f"{DESCRIPTION}: expected an object of tensor names and types")
    for key in _REFUSED_KEYS:
        if description.get(key) not in _UNSET:
            raise ValueError(f"{DESCRIPTION}: {key} {description[key]!r} is not supported (quantized KV cache or "
                             "attention): Sluice keeps them in the model's dtype")
    if description.get("group_size") not in _UNSET:
        raise ValueError(f"{DESCRIPTION}: group_size {description['group_size']!r} is not supported: per-group "
                         "weight scales (Sluice reads one scale per output channel)")
    names = set(names)
    for name in names:
        _refuse_norm_bias(name)
    types: dict[str, str] = {}
    parts: dict[str, frozenset[str]] = {}
    fused: dict[str, dict[str, str]] = {}   # our fused parameter -> {checkpoint weight: type}
    # Weights first, so that a refused type is named on its weight; a norm's weight is not a linear's, whatever
    # its entry says (msModelSlim's older descriptions give norms the model's type; vLLM-Ascend reads the entries of
    # linear layers only).
    weights = sorted(n for n in names if n.endswith(".weight") and "norm" not in n.rsplit(".", 2)[-2])
    for name in weights:
        kind = description.get(name, FLOAT)
        if kind != FLOAT and kind not in _PARTS:
            raise ValueError(f"{name}: msModelSlim type {kind!r} is not supported ({_RUNS})")
        target = map_name(name, config)
        if target is not None:
            fused.setdefault(target[0], {})[name] = kind
        if kind != FLOAT:
            types[name.removesuffix(".weight")] = kind
    for name in sorted(names - set(weights)):
        kind = description.get(name, FLOAT)
        if kind not in (FLOAT, STATIC, DYNAMIC) and not name.endswith(".weight"):
            raise ValueError(f"{name}: msModelSlim type {kind!r} is not supported ({_RUNS})")
    for param, members in fused.items():
        if len(set(members.values())) > 1:
            listed = ", ".join(f"{n}: {t}" for n, t in sorted(members.items()))
            raise ValueError(f"{param}: the parts of a fused projection must have one msModelSlim type ({listed})")
    for base, kind in types.items():
        name = base + ".weight"
        if ".self_attn.qkv_proj." in name or (".mlp.gate_up_proj." in name and ".experts." not in name):
            raise ValueError(f"{name}: a projection fused in the checkpoint is not supported quantized ({kind})")
        if kind == STATIC and EXPERT.search(name) is not None:
            raise ValueError(f"{name}: static W8A8 experts are not supported (vLLM-Ascend has no such scheme either; "
                             "W8A8_DYNAMIC experts are read)")
        required, optional = _PARTS[kind]
        for suffix in required:
            if base + suffix not in names:
                raise ValueError(f"msModelSlim checkpoint: {base}{suffix} is missing ({name} is {kind})")
        parts[base] = frozenset((".weight", *required, *(s for s in optional if base + s in names)))
    return ModelSlimScheme(types, parts)



def _refuse_norm_bias(name: str) -> None:
    if name.endswith(("norm.bias", ".module.weight", ".module.bias")):
        raise ValueError(f"{name}: normalization biases and rescaled norm copies (msModelSlim's anti-outlier "
                         "outputs) are not supported")


def shard_of(weight_shard: Callable[[str], Shard | None],
             scheme: ModelSlimScheme) -> Callable[[str], Shard | None]:
    """The shard function of an msModelSlim checkpoint's tensors from the model's: per-channel tensors follow their
    weight's rows (a column-parallel shard) or are whole (a row-parallel one); per-tensor ones are whole; tensors a
    type does not read are not read (None)."""
    def shard(name: str) -> Shard | None:
        for suffix in (*_PER_CHANNEL, *_PER_TENSOR):
            if name.endswith(suffix):
                base = name.removesuffix(suffix)
                if base in scheme.parts and suffix not in scheme.parts[base]:
                    return None
                weight = weight_shard(base + ".weight")
                if weight is None:
                    return None
                return weight if weight.dim == 0 and suffix in _PER_CHANNEL else WHOLE
        return weight_shard(name)

    return shard


def split_int8(tensors: Iterable[tuple[str, torch.Tensor]], scheme: ModelSlimScheme, dtype: torch.dtype,
               weight_shard: Callable[[str], Shard | None],
               int8: list[tuple[str, AnyInt8Weight]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model's float ones (each quantized ``<linear>.weight`` dequantized to
    ``dtype``, its companions consumed), appending each quantized linear's exact weight to ``int8`` as its last
    tensor arrives. Raises ValueError naming the tensor for an int8 tensor the description does not quantize, or
    values the type cannot hold."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        base, suffix = _owner(name, scheme)
        if base is None:
            if tensor.dtype == torch.int8:
                raise ValueError(f"{name} is int8 but {DESCRIPTION} does not give it a type Sluice reads as int8 "
                                 f"({STATIC} or {DYNAMIC})")
            yield name, tensor
            continue
        got = pending.setdefault(base, {})
        got[suffix] = tensor
        if got.keys() != scheme.parts[base]:
            continue
        del pending[base]
        weight: AnyInt8Weight
        if scheme.types[base] == STATIC:
            shard = weight_shard(base + ".weight")
            weight = _static_weight(base, got, first_rank=shard is None or shard.dim != 1 or shard.start == 0)
        else:
            weight = _dynamic_weight(base, got)
        int8.append((base + ".weight", weight))
        yield base + ".weight", weight.dequantize().to(dtype)
    for base, got in pending.items():
        missing = sorted(scheme.parts[base] - got.keys())
        raise ValueError(f"msModelSlim checkpoint: {base}{missing[0]} is missing")


def _owner(name: str, scheme: ModelSlimScheme) -> tuple[str | None, str]:
    """(quantized linear, suffix) of one of its tensors, or (None, "")."""
    for suffix in (".weight", *_PER_CHANNEL, *_PER_TENSOR):
        base = name.removesuffix(suffix)
        if name.endswith(suffix) and base in scheme.parts and suffix in scheme.parts[base]:
            return base, suffix
    return None, ""


def _codes(base: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != torch.int8 or tensor.dim() != 2:
        raise ValueError(f"{base}.weight: expected int8 [out, in] codes, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.contiguous()


def _per_channel(base: str, suffix: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-output-channel tensor ([rows] or [rows, 1]) as [rows]."""
    if tensor.numel() != rows or tensor.dim() > 2 or (tensor.dim() == 2 and tensor.shape[1] != 1):
        raise ValueError(f"{base}{suffix}: shape {tuple(tensor.shape)} is not one value per output channel of the "
                         f"{rows}-row weight (per-group scales are not supported)")
    return tensor.reshape(rows)


def _scalar(base: str, suffix: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() != 1 or (not tensor.dtype.is_floating_point and tensor.dtype != torch.int8):
        raise ValueError(f"{base}{suffix}: expected one value per tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.reshape(()).float()


def _deq_scale(base: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 [rows] from a float ``deq_scale`` or its int64 form (the float32's bits, msModelSlim's
    ``deqscale2int64`` for float16 models)."""
    values = _per_channel(base, ".deq_scale", tensor, rows)
    if values.dtype == torch.int64:
        if bool(((values < 0) | (values >= 2**31)).any()):
            raise ValueError(f"{base}.deq_scale: int64 values that are not a positive float32's bits")
        values = values.to(torch.int32).view(torch.float32)
    elif not values.dtype.is_floating_point:
        raise ValueError(f"{base}.deq_scale: expected float32 or int64 (float32 bits), got {values.dtype}")
    values = values.float().contiguous()
    if not bool(torch.isfinite(values).all()) or bool((values <= 0).any()):
        raise ValueError(f"{base}.deq_scale: scales must be finite and positive")
    return values


def _static_weight(base: str, got: dict[str, torch.Tensor], first_rank: bool) -> StaticInt8Weight:
    codes = _codes(base, got[".weight"])
    rows = codes.shape[0]
    scale = _scalar(base, ".input_scale", got[".input_scale"])
    offset = _scalar(base, ".input_offset", got[".input_offset"])
    if not bool(torch.isfinite(scale)) or float(scale) <= 0:
        raise ValueError(f"{base}.input_scale: {float(scale)} is not a positive scale")
    if float(offset) != round(float(offset)) or not -128 <= float(offset) <= 127:
        raise ValueError(f"{base}.input_offset: {float(offset)} is not an int8 offset")
    quant_bias = _per_channel(base, ".quant_bias", got[".quant_bias"], rows)
    if quant_bias.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{base}.quant_bias: expected int32, got {quant_bias.dtype}")
    quant_bias = quant_bias.to(torch.int32).contiguous()
    if not first_rank:
        quant_bias = torch.zeros_like(quant_bias)
    return StaticInt8Weight(codes, scale, offset, _deq_scale(base, got[".deq_scale"], rows), quant_bias)


def _dynamic_weight(base: str, got: dict[str, torch.Tensor]) -> Int8Weight:
    codes = _codes(base, got[".weight"])
    rows = codes.shape[0]
    scale = _per_channel(base, ".weight_scale", got[".weight_scale"], rows).float().contiguous()
    offset = got.get(".weight_offset")
    if offset is not None and bool(torch.count_nonzero(_per_channel(base, ".weight_offset", offset, rows))):
        raise ValueError(f"{base}.weight_offset: non-zero weight offsets (asymmetric weights) are not supported")
    return Int8Weight(codes, scale)


def drop_folded_biases(model: nn.Module) -> None:
    """Static linears' float biases are in their ``quant_bias``: the layers drop the file's copy, so that no path
    (a row-parallel layer adds its bias after the ranks' sum) adds it twice."""
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.int8, StaticInt8Weight) and module.bias is not None:
            module.bias = None  # type: ignore[assignment]
