"""Weight-only 4-bit checkpoints: which format a config.json's ``quantization_config`` is (GPTQ, AWQ,
compressed-tensors W4A16, detected as vLLM does), whether ``--quantization`` agrees with it, and how its packed
tensors become the model's weights.

Loading: each projection's packed tensors are read whole, unpacked into an ``Int4Weight`` (act-order columns
sorted once), cut to this rank's shard (rows of a column-parallel layer; whole groups of input columns of a
row-parallel one) and handed to the model twice: dequantized, as the float weight ``load_weights`` checks and
places (freed when the layer picks its method), and as the ``Int4Weight`` its ``Linear.int4`` holds
(``attach``), the parts of q/k/v and gate/up stacked by rows.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from common.errors import InvalidRequestError
from engine.models import awq, ct_w4a16, gptq
from engine.models.int4 import Int4Weight
from engine.models.sharding import WHOLE, Shard
from engine.models.weight_names import num_parts

if TYPE_CHECKING:
    from engine.models.llama import CausalLM

# The --quantization values that name a 4-bit format (compressed-tensors also names W8A8 checkpoints).
FLAGS = (gptq.QUANT_METHOD, awq.QUANT_METHOD)


class Int4Format(Protocol):
    """What a 4-bit checkpoint format reader offers (``gptq.GptqFormat`` and the others)."""

    @property
    def name(self) -> str: ...          # its quant_method
    @property
    def suffixes(self) -> tuple[str, ...]: ...   # a projection's tensors
    @property
    def optional(self) -> tuple[str, ...]: ...
    def describe(self) -> str: ...
    def unpack(self, base: str, tensors: dict[str, torch.Tensor]) -> Int4Weight: ...


def read_format(config: dict[str, Any]) -> Int4Format | None:
    """The 4-bit format of a config.json, or None when it is not one (no ``quantization_config``, or another
    compressed-tensors scheme). Raises ValueError naming the key for a GPTQ / AWQ / pack-quantized configuration
    that is not read (3-bit GPTQ, AWQ GEMV, ...)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == gptq.QUANT_METHOD:
        return gptq.read_format(qc)
    if method == awq.QUANT_METHOD:
        return awq.read_format(qc)
    if method == ct_w4a16.QUANT_METHOD and ct_w4a16.is_w4a16(qc):
        return ct_w4a16.read_format(qc)
    return None


def check_flag(quantization: str | None, fmt: Int4Format | None, path: str) -> None:
    """Raises InvalidRequestError naming ``quantization`` when it contradicts the checkpoint: ``gptq`` / ``awq``
    on anything but such a checkpoint, or any flag but the checkpoint's own (or none) on a 4-bit one."""
    if fmt is None:
        if quantization in FLAGS:
            raise InvalidRequestError("quantization", f"{quantization!r} needs a {quantization.upper()} checkpoint "
                                                      f"(config.json's quantization_config.quant_method "
                                                      f"{quantization!r}); {path} is not one")
        return
    if quantization is not None and quantization != fmt.name:
        raise InvalidRequestError("quantization", f"{path} is a {fmt.describe()} checkpoint: --quantization "
                                                  f"{quantization!r} does not apply to it (give {fmt.name!r} or "
                                                  "none)")


def check_checkpoint(path: str, quantization: str | None, device: str = "cpu") -> None:
    """What loading refuses about a Hugging Face directory's quantization, from its config.json alone (no weight
    read), so that the commands refuse it before any process starts (exit 2): a 4-bit format Sluice does not read
    (3-bit GPTQ, AWQ GEMV, ...), an unknown ``quant_method``, a ``--quantization`` that contradicts the checkpoint,
    a 4-bit checkpoint on CUDA (no kernel). Raises InvalidRequestError naming ``--model`` (or ``quantization``, for
    the flag, ``--device`` for the device)."""
    from engine.models import compressed_tensors, modelslim

    directory = Path(path)
    file = directory / "config.json"
    if not file.is_file() or modelslim.has_description(directory):
        return
    config = json.loads(file.read_text())
    try:
        fmt = read_format(config)
        check_flag(quantization, fmt, path)
        if fmt is None and isinstance(config.get("quantization_config"), dict):
            compressed_tensors.read_scheme(config)
    except InvalidRequestError:
        raise
    except ValueError as e:
        raise InvalidRequestError("--model", f"{path}: {e}") from e
    if fmt is not None and device == "cuda":
        raise InvalidRequestError("--device", f"{path} is a {fmt.describe()} checkpoint: 4-bit weights run on cpu "
                                              "and npu (no CUDA W4A16 kernel is wired)")


def _split(name: str, fmt: Int4Format) -> tuple[str, str] | None:
    for suffix in (*fmt.suffixes, *fmt.optional):
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return None


def shard_of(weight_shard: Callable[[str], Shard | None], fmt: Int4Format) -> Callable[[str], Shard | None]:
    """What to read of each tensor: a projection's packed tensors whole (on the ranks that hold the projection;
    ``split_int4`` cuts them once unpacked), the others as the model shards them."""
    def shard(name: str) -> Shard | None:
        parts = _split(name, fmt)
        if parts is None:
            return weight_shard(name)
        return None if weight_shard(parts[0] + ".weight") is None else WHOLE

    return shard


def split_int4(tensors: Iterable[tuple[str, torch.Tensor]], fmt: Int4Format, dtype: torch.dtype,
               weight_shard: Callable[[str], Shard | None],
               int4: list[tuple[str, Int4Weight]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model's float ones: each projection's packed tensors, once all have come,
    unpacked, cut to ``weight_shard(<proj>.weight)`` and yielded dequantized to ``dtype`` as ``<proj>.weight``,
    its ``Int4Weight`` appended to ``int4``. Raises ValueError naming the tensor when one is missing, and for
    projections fused in the file (``qkv_proj``, ``gate_up_proj``)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        parts = _split(name, fmt)
        if parts is None:
            yield name, tensor
            continue
        base, suffix = parts
        if ".qkv_proj" in base or ".gate_up_proj" in base or ".experts." in base:
            raise ValueError(f"{name}: 4-bit {'experts' if '.experts.' in base else 'projections fused in the file'}"
                             " are not supported")
        got = pending.setdefault(base, {})
        got[suffix] = tensor
        if all(s in got for s in (*fmt.suffixes, *fmt.optional)):
            yield base + ".weight", _unpack(base, pending.pop(base), fmt, dtype, weight_shard, int4)
    for base, got in pending.items():   # projections without some optional tensor (GPTQ files without g_idx)
        missing = [s for s in fmt.suffixes if s not in got]
        if missing:
            raise ValueError(f"{fmt.describe()} checkpoint: {base}{missing[0]} is missing")
        yield base + ".weight", _unpack(base, got, fmt, dtype, weight_shard, int4)


def _unpack(base: str, got: dict[str, torch.Tensor], fmt: Int4Format, dtype: torch.dtype,
            weight_shard: Callable[[str], Shard | None], int4: list[tuple[str, Int4Weight]]) -> torch.Tensor:
    """One projection's ``Int4Weight`` (this rank's shard) appended to ``int4``; returns it dequantized."""
    shard = weight_shard(base + ".weight")
    assert shard is not None
    local = fmt.unpack(base, got).take(shard, base)
    int4.append((base + ".weight", local))
    return local.dequantize().to(dtype)


def attach(model: CausalLM, weights: Iterable[tuple[str, Int4Weight]]) -> int:
    """Gives the model's linears their 4-bit weights (named and sharded as ``load_weights`` had them), stacking
    the parts of fused projections, and frees the float weights they replace. Raises ValueError for a 4-bit
    embedding table or experts, and when only some parts of a fused projection come in 4 bits. Returns how many
    linears got one."""
    from engine.models.layers.linear import Linear

    shards: dict[str, dict[int, Int4Weight]] = {}
    for hf_name, weight in weights:
        target = model._target(hf_name)
        if target is None:
            continue
        if target[0] == "embed_tokens.weight" or ".mlp.experts." in target[0]:
            raise ValueError(f"{hf_name}: 4-bit {'embedding tables' if 'embed' in target[0] else 'experts'} are "
                             "not supported")
        shards.setdefault(target[0], {})[target[1]] = weight
    for name, parts in shards.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        expected = num_parts(name, model.plan)
        if len(parts) != expected or not isinstance(module, Linear):
            raise ValueError(f"{name}: the parts of a fused projection must all be 4-bit or all float (got 4-bit "
                             f"for {len(parts)} of {expected})")
        fused = Int4Weight.cat([parts[i] for i in range(len(parts))], name)
        if module.is_lm_head and fused.shape[0] < module.out_features:   # the vocabulary shard's padding rows
            fused = fused.pad_rows(module.out_features)
        if fused.shape != (module.out_features, module.in_features):
            raise ValueError(f"{name}: 4-bit weight shape {fused.shape} != expected "
                             f"{(module.out_features, module.in_features)}")
        module.int4 = replace(fused.to(module.weight.device), dtype=module.weight.dtype)
        module.quant = None
        if not module.shares_weight:
            module.weight = None  # type: ignore[assignment]
    return len(shards)
