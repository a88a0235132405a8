"""GGUF files of the dense families laid out unlike Llama, read as llama.cpp reads them: Gemma 2, Gemma 3 (text),
Phi-3 / Phi-4 and GLM-4 (0414). Their metadata is read as the Hugging Face config it was converted from, and mapped
onto ModelConfig by ``engine.models.config``'s own readers.

Gemma: llama.cpp's converter stores every norm weight as 1 + weight (Gemma's RMSNorm scales by 1 + weight), so the
weights load as stored (``norm_weight_offset`` 0). ``post_attention_norm`` is the norm after attention and
``ffn_norm`` the one before the MLP. No query_pre_attn_scalar is written: llama.cpp scales queries by
head_dim ** -0.5, or (hidden / heads) ** -0.5 in the 27B models, which it tells by their layer count (as Google's
reference does). Gemma 2 slides on the even layers, over 4096 tokens unless the file says, and soft-caps scores at
50 and logits at 30 unless it says; Gemma 3 slides on five layers of six only when the file has a window, those
layers on their own rope base (``rope.freq_base_swa``, else 10000). A file's ``attention.sliding_window_pattern``
(a period, or a flag per layer) replaces the default pattern.

Phi-3: ``attn_qkv`` holds q, k and v, ``ffn_up`` gate and up; each is read as its parts' row ranges (views of the
mapped file), so a quantized file keeps its blocks for every part (and a tensor-parallel rank reads its rows of each
part alone). The file's sliding window (0: none) applies in every layer, as transformers applies the checkpoint's
(llama.cpp ignores it for now). ``rope.dimension_count`` is the rotated part of each head. LongRoPE's per-pair
divisors are the tensors ``rope_factors_short`` / ``rope_factors_long``, its original context
``rope.scaling.original_context_length`` and its attention factor ``rope.scaling.attn_factor`` (the converter's
sqrt(1 + ln(context / original) / ln(original)), transformers' own default when absent); the factor is the context
over the original one. They are read by ``config.longrope_from_hf``, as a checkpoint's are.

GLM-4: rope over ``rope.dimension_count`` of each head (half, by default) in interleaved pairs, q/k/v as written (no
permutation), ``ffn_up`` fused as Phi-3's, and the sandwich norms: ``post_attention_norm`` after attention,
``ffn_norm`` before the MLP and ``post_ffw_norm`` after it, named as the checkpoint names them (weight_names maps
those). The YaRN scaling a newer converter writes for a YaRN checkpoint is refused, as in the other families.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gguf import ReaderTensor
from gguf.quants import dequantize

from engine.models.config import (
    RopeScaling,
    gemma2_from_hf,
    gemma3_from_hf,
    longrope_from_hf,
    sliding_window_from_hf,
)

# A GGUF metadata value by its name under the file's architecture, or the default.
Key = Callable[..., Any]

# GGUF architecture -> model_type
ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "glm4": "glm4"}
# LongRoPE's short and long divisors (Phi-3), read into the config.
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")

_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# GLM-4's checkpoint names (ffn_norm is its post_attention_layernorm, as Llama's is)
_GLM4_NORMS = {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm"}
# Layer tensors named unlike Llama's, by architecture.
LAYER_NAMES: dict[str, dict[str, str]] = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS, "glm4": _GLM4_NORMS}

# llama.cpp's defaults: the sliding pattern's period, and the layer count that marks a 27B model.
_PATTERN = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_FUSED = re.compile(r"blk\.(\d+)\.(attn_qkv|ffn_up)\.(weight|bias)")
_FUSED_ARCHITECTURES = ("phi3", "glm4")


def config_fields(gguf_arch: str, key: Key, tensors: Mapping[str, ReaderTensor]) -> dict[str, Any]:
    """The ModelConfig fields a Gemma 2 / Gemma 3 / Phi-3 / GLM-4 file sets beyond Llama's (Phi-3's LongRoPE as
    ``rope_scaling``); {} for other architectures. Raises ValueError naming what is not supported."""
    if gguf_arch == "phi3":
        return _phi3(key, tensors)
    if gguf_arch == "glm4":
        return {"partial_rotary_factor": _partial_rotary("glm4", key), "rope_interleaved": True,
                "sandwich_norms": True}
    if gguf_arch in ("gemma2", "gemma3"):
        return _gemma(gguf_arch, key)
    return {}


def _gemma(gguf_arch: str, key: Key) -> dict[str, Any]:
    layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    gemma2 = gguf_arch == "gemma2"
    window = key("attention.sliding_window", 4096 if gemma2 else None)
    types = (_layer_types(key("attention.sliding_window_pattern", _PATTERN[gguf_arch]), layers) if window
             else ["full_attention"] * layers)
    cfg: dict[str, Any] = {
        "num_hidden_layers": layers, "max_position_embeddings": int(key("context_length", 4096)),
        "sliding_window": window, "layer_types": types,
        "query_pre_attn_scalar": hidden // heads if layers == _LAYERS_27B[gguf_arch] else head_dim,
        "final_logit_softcapping": key("final_logit_softcapping", 30.0 if gemma2 else None),
    }
    if gemma2:
        fields = gemma2_from_hf({**cfg, "attn_logit_softcapping": key("attn_logit_softcapping", 50.0)})
        if (local := key("rope.freq_base_swa")) is not None:
            fields.update(rope_local_theta=float(local),
                          rope_local_layers=frozenset(i for i, t in enumerate(types) if t == "sliding_attention"))
    else:
        local = float(key("rope.freq_base_swa", 10_000.0))
        fields = gemma3_from_hf({**cfg, "rope_parameters": {"sliding_attention": {"rope_theta": local}}})
    window, sliding = sliding_window_from_hf(cfg, ARCHITECTURES[gguf_arch])
    return {**fields, "sliding_window": window, "sliding_layers": sliding, "hidden_act": "gelu_pytorch_tanh",
            "norm_weight_offset": 0.0}   # the converter stored 1 + weight


def _layer_types(pattern: Any, layers: int) -> list[str]:
    """llama.cpp's ``set_swa_pattern``: with period p, every layer slides but the last of each p (p = 0: all of
    them); or a flag per layer."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF attention.sliding_window_pattern has {len(pattern)} flags for {layers} layers")
        flags = [bool(v) for v in pattern]
    else:
        period = int(pattern)
        flags = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if f else "full_attention" for f in flags]


def _phi3(key: Key, tensors: Mapping[str, ReaderTensor]) -> dict[str, Any]:
    cfg = {"num_hidden_layers": int(key("block_count")), "max_position_embeddings": int(key("context_length", 4096)),
           "sliding_window": key("attention.sliding_window") or None}
    window, sliding = sliding_window_from_hf(cfg, "phi3")
    partial = _partial_rotary("phi3", key)
    fields: dict[str, Any] = {"sliding_window": window, "sliding_layers": sliding, "partial_rotary_factor": partial}
    if any(name in tensors for name in ROPE_FACTORS):
        fields["rope_scaling"] = _longrope(key, tensors, cfg, int(_head_dim(key) * partial))
    return fields


def _head_dim(key: Key) -> int:
    return int(key("attention.key_length", int(key("embedding_length")) // int(key("attention.head_count"))))


def _partial_rotary(gguf_arch: str, key: Key) -> float:
    """``rope.dimension_count`` (llama.cpp's default: the whole head) as the fraction of each head rotated."""
    head_dim = _head_dim(key)
    rotary = int(key("rope.dimension_count", head_dim))
    factor = rotary / head_dim
    if rotary % 2 or not 0 < rotary <= head_dim or int(head_dim * factor) != rotary:
        raise ValueError(f"{gguf_arch}: rope.dimension_count={rotary} of head_dim {head_dim} is not supported (an even "
                         "count of at most the head's dimensions)")
    return factor


def _longrope(key: Key, tensors: Mapping[str, ReaderTensor], cfg: dict[str, Any], rotary_dim: int) -> RopeScaling:
    """Phi-3's LongRoPE from the file, as the checkpoint's ``rope_scaling`` it was converted from (``cfg``: its
    context)."""
    if missing := [name for name in ROPE_FACTORS if name not in tensors]:
        raise ValueError(f"phi3: LongRoPE without the tensor {missing[0]!r}")
    if (kind := key("rope.scaling.type", "none")) not in ("none", "longrope"):
        raise ValueError(f"phi3: rope scaling {kind!r} with LongRoPE's factors is not supported")
    short, long = ([float(v) for v in dequantize(tensors[name].data, tensors[name].tensor_type).reshape(-1)]
                   for name in ROPE_FACTORS)
    pairs = rotary_dim // 2
    if len(short) != pairs or len(long) != pairs:
        raise ValueError(f"phi3: LongRoPE factors of {len(short)} and {len(long)} values, not {pairs} (one per rotated "
                         "pair of dimensions)")
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": key("rope.scaling.original_context_length"),
               "attention_factor": key("rope.scaling.attn_factor")}
    return longrope_from_hf(scaling, cfg)


def split_fused(tensor: ReaderTensor, gguf_arch: str, q_size: int, kv_size: int
                ) -> list[tuple[str, ReaderTensor]] | None:
    """Phi-3's and GLM-4's ``attn_qkv`` as q_proj / k_proj / v_proj and ``ffn_up`` as gate_proj / up_proj (Hugging
    Face names), each a row range of the tensor; None for any other tensor."""
    if gguf_arch not in _FUSED_ARCHITECTURES or (m := _FUSED.fullmatch(tensor.name)) is None:
        return None
    layer, kind, suffix = m.groups()
    rows = int(tensor.shape[-1])   # GGUF lists dims innermost first
    parts = ([("self_attn.q_proj", q_size), ("self_attn.k_proj", kv_size), ("self_attn.v_proj", kv_size)]
             if kind == "attn_qkv" else [("mlp.gate_proj", rows // 2), ("mlp.up_proj", rows // 2)])
    if sum(size for _, size in parts) != rows:
        raise ValueError(f"GGUF tensor {tensor.name!r} has {rows} rows, not {' + '.join(str(s) for _, s in parts)}")
    split, start = [], 0
    for name, size in parts:
        split.append((f"model.layers.{layer}.{name}.{suffix}", _rows(tensor, start, size)))
        start += size
    return split


def _rows(tensor: ReaderTensor, start: int, count: int) -> ReaderTensor:
    """Rows ``start`` .. ``start + count`` of a tensor, a view of its data."""
    shape = tensor.shape.copy()
    shape[-1] = count
    data = tensor.data[start:start + count]
    return tensor._replace(shape=shape, n_elements=int(np.prod(shape)), n_bytes=int(data.nbytes), data=data)
