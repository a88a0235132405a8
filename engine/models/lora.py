"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) into the
per-module matrices the LoRA linear method computes with, validated against the loaded model.

Everything an adapter could ask that Sluice would not honour is refused here, at load, with a message naming the
file and the field or tensor: serving an adapter with part of it silently dropped would give wrong answers.
The scaling PEFT applies (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; ``alpha_pattern`` matched
as PEFT matches it) is folded into B once, here, so a step computes ``(x @ A.T) @ B.T`` and nothing more.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.errors import InvalidRequestError
from engine.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
FIELD = "lora_path"

# The modules an adapter may target, and where each lives in our fused layout: (fused layer, slice in it).
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

# PEFT's saved names: base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter}].weight
# (save_pretrained drops the adapter name; a state dict taken from a live PeftModel still has it).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted module of one layer: ``a`` [r, in], ``b`` [out, r] with the adapter's scaling folded in."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's validated weights, on the host, keyed by (layer index, module name such as ``q_proj``)."""

    path: str
    modules: dict[tuple[int, str], LoRAWeights]

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def module_shape(module: str, config: ModelConfig) -> tuple[int, int]:
    """(out, in) features of one of the seven target modules in a model of ``config``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (config.q_size, hidden), "k_proj": (config.kv_size, hidden),
            "v_proj": (config.kv_size, hidden), "o_proj": (hidden, config.q_size),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[module]


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(FIELD, message)


def read_adapter_config(folder: Path, max_rank: int) -> dict[str, Any]:
    """``adapter_config.json``, checked for what Sluice serves: plain LoRA on the seven projections."""
    if not folder.is_dir():
        raise _refuse(f"adapter folder {str(folder)!r} does not exist")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(f"{CONFIG_FILE} is missing from {str(folder)!r}: not a PEFT adapter folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _refuse(f"{CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise _refuse(f"{CONFIG_FILE} must hold a JSON object")

    def check(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise _refuse(f"{CONFIG_FILE}: {field} {why}")

    peft_type = config.get("peft_type")
    check(peft_type == "LORA", "peft_type", f"is {peft_type!r}; only LORA adapters are served")
    r: Any = config.get("r")
    check(isinstance(r, int) and not isinstance(r, bool) and r >= 1, "r", f"must be a positive integer, got {r!r}")
    check(r <= max_rank, "r", f"is {r}, above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    check(_is_number(alpha), "lora_alpha", f"must be a number, got {alpha!r}")
    for field in ("use_dora", "fan_in_fan_out", "use_rslora", "lora_bias"):
        check(isinstance(config.get(field, False), bool), field, "must be true or false")
    check(not config.get("use_dora", False), "use_dora", "is true: DoRA adapters are not supported")
    check(not config.get("fan_in_fan_out", False), "fan_in_fan_out",
          "is true: only adapters of nn.Linear layers (out x in weights) are supported")
    check(not config.get("lora_bias", False), "lora_bias", "is true: LoRA biases are not supported")
    bias = config.get("bias", "none")
    check(bias == "none", "bias", f"is {bias!r}: adapters that train the base layers' biases are not supported "
                                  f"(only \"none\")")
    to_save = config.get("modules_to_save")
    check(not to_save, "modules_to_save", f"is {to_save!r}: adapters that replace whole modules are not supported "
                                          f"(only LoRA matrices on {', '.join(TARGET_MODULES)})")
    check(not config.get("layer_replication"), "layer_replication", "is set: layer replication is not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        check(isinstance(pattern, dict) and all(_is_number(v) for v in pattern.values()), field,
              "must map module names to numbers")
        config[field] = pattern
    return config


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def pattern_key(pattern_keys: list[str], module_key: str) -> str | None:
    """The first key of a PEFT ``rank_pattern`` / ``alpha_pattern`` that names ``module_key`` (e.g.
    ``model.layers.0.self_attn.q_proj``): PEFT's rule, a regex matched against a dotted suffix of the name."""
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return key
    return None


def load_adapter(folder: str, config: ModelConfig, *, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Reads and validates the adapter in ``folder`` for a model of ``config``; weights in ``dtype`` on the host.

    Raises InvalidRequestError (field ``lora_path``) naming the file and the field or tensor at fault.
    """
    root = Path(folder)
    adapter_config = read_adapter_config(root, max_rank)
    tensors = _read_tensors(root)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer, module, which = _place(name, config)
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise _refuse(f"{WEIGHTS_FILE} holds no LoRA tensors")
    alpha_pattern: dict[str, float] = adapter_config["alpha_pattern"]
    default_alpha = float(adapter_config.get("lora_alpha", 8))
    rslora = bool(adapter_config.get("use_rslora", False))
    modules: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), pair in sorted(pairs.items()):
        key = f"model.layers.{layer}.{_PARENT[module]}.{module}"
        a, b = _check_pair(key, pair, module_shape(module, config), max_rank)
        rank = a.shape[0]
        matched = pattern_key(list(alpha_pattern), key)
        alpha = float(alpha_pattern[matched]) if matched is not None else default_alpha
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        # Scaled in float32 before any narrowing, as PEFT scales its float32 product.
        modules[(layer, module)] = LoRAWeights(a=a.float().to(dtype).contiguous(),
                                               b=(b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(path=folder, modules=modules)


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    path = root / WEIGHTS_FILE
    if not path.is_file():
        if (root / PICKLE_FILE).is_file():
            raise _refuse(f"only {PICKLE_FILE} was found, a pickle, which Sluice never loads (it can run code): "
                          f"convert it to {WEIGHTS_FILE} (PeftModel.save_pretrained(..., safe_serialization=True))")
        raise _refuse(f"{WEIGHTS_FILE} is missing from {str(root)!r}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise _refuse(f"{WEIGHTS_FILE} cannot be read: {e}") from e


def _place(name: str, config: ModelConfig) -> tuple[int, str, str]:
    """(layer index, module, "A" | "B") of a tensor, or a refusal naming what it adapts."""
    m = _TENSOR.match(name)
    targets = ", ".join(TARGET_MODULES)
    if m is None:
        if ".lora_" not in name:
            raise _refuse(f"{WEIGHTS_FILE}: tensor {name!r} is not a LoRA matrix (lora_A / lora_B)")
        module = name.split(".lora_")[0].removeprefix("base_model.model.")
        raise _refuse(f"{WEIGHTS_FILE}: tensor {name!r} adapts {module!r}, which this model has no LoRA target "
                      f"for: target_modules must be among {targets}")
    layer, parent, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    if _PARENT.get(module) != parent:
        raise _refuse(f"{WEIGHTS_FILE}: tensor {name!r} adapts {parent}.{module}, which this model has no LoRA "
                      f"target for: target_modules must be among {targets}")
    if layer >= config.num_layers:
        raise _refuse(f"{WEIGHTS_FILE}: tensor {name!r} adapts layer {layer}, but the model has "
                      f"{config.num_layers} layers (target_modules / layers_to_transform)")
    return layer, module, which


def _check_pair(key: str, pair: dict[str, torch.Tensor], shape: tuple[int, int], max_rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    for which, other in (("A", "B"), ("B", "A")):
        if which in pair and other not in pair:
            raise _refuse(f"{WEIGHTS_FILE}: {key} has lora_{which} but no lora_{other}")
    a, b = pair["A"], pair["B"]
    out_features, in_features = shape
    name_a, name_b = f"{key}.lora_A.weight", f"{key}.lora_B.weight"
    if a.dim() != 2 or b.dim() != 2:
        raise _refuse(f"{WEIGHTS_FILE}: tensors {name_a!r} and {name_b!r} must be matrices")
    rank = a.shape[0]
    if rank > max_rank:
        raise _refuse(f"{WEIGHTS_FILE}: tensor {name_a!r} has rank {rank}, above --max-lora-rank {max_rank}")
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise _refuse(f"{WEIGHTS_FILE}: tensors {name_a!r} {tuple(a.shape)} and {name_b!r} {tuple(b.shape)} do not "
                      f"fit the model's layer ({in_features} in, {out_features} out): an adapter for another base "
                      f"model")
    if b.shape[1] != rank:
        raise _refuse(f"{WEIGHTS_FILE}: tensor {name_b!r} has rank {b.shape[1]} but {name_a!r} has rank {rank}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise _refuse(f"{WEIGHTS_FILE}: tensors {name_a!r} and {name_b!r} must be floating point")
    return a, b
