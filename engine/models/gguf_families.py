"""GGUF files of the dense families laid out unlike Llama, read as llama.cpp reads them: Gemma 2, Gemma 3 (text) and
Phi-3 / Phi-4. Their metadata is read as the Hugging Face config it was converted from, and mapped onto ModelConfig
by ``engine.models.config``'s own readers.

Gemma: llama.cpp's converter stores every norm weight as 1 + weight (Gemma's RMSNorm scales by 1 + weight), so the
weights load as stored (``norm_weight_offset`` 0). ``post_attention_norm`` is the norm after attention and
``ffn_norm`` the one before the MLP. No query_pre_attn_scalar is written: llama.cpp scales queries by
head_dim ** -0.5, or (hidden / heads) ** -0.5 in the 27B models, which it tells by their layer count (as Google's
reference does). Gemma 2 slides on the even layers, over 4096 tokens unless the file says, and soft-caps scores at
50 and logits at 30 unless it says; Gemma 3 slides on five layers of six only when the file has a window, those
layers on their own rope base (``rope.freq_base_swa``, else 10000). A file's ``attention.sliding_window_pattern``
(a period, or a flag per layer) replaces the default pattern.

Phi-3: ``attn_qkv`` holds q, k and v, ``ffn_up`` gate and up; each is read as its parts' row ranges (views of the
mapped file), so a quantized file keeps its blocks for every part. The file's sliding window (0: none) applies in
every layer, as transformers applies the checkpoint's (llama.cpp ignores it for now). LongRoPE and partial rotary
are refused.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gguf import ReaderTensor

from engine.models.config import gemma2_from_hf, gemma3_from_hf, sliding_window_from_hf

# A GGUF metadata value by its name under the file's architecture, or the default.
Key = Callable[..., Any]

# GGUF architecture -> model_type
ARCHITECTURES = {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}

_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Layer tensors named unlike Llama's, by architecture.
LAYER_NAMES: dict[str, dict[str, str]] = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS}

# llama.cpp's defaults: the sliding pattern's period, and the layer count that marks a 27B model.
_PATTERN = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_FUSED = re.compile(r"blk\.(\d+)\.(attn_qkv|ffn_up)\.(weight|bias)")


def config_fields(gguf_arch: str, key: Key, tensors: Mapping[str, ReaderTensor]) -> dict[str, Any]:
    """The ModelConfig fields a Gemma 2 / Gemma 3 / Phi-3 file sets beyond Llama's; {} for other architectures.
    Raises ValueError naming what is not supported."""
    if gguf_arch == "phi3":
        return _phi3(key, tensors)
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
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise ValueError("phi3: LongRoPE (the file's rope_factors_long / rope_factors_short) is not supported")
    head_dim = int(key("embedding_length")) // int(key("attention.head_count"))
    if (rotary := int(key("rope.dimension_count", head_dim))) != head_dim:
        raise ValueError(f"phi3: partial rotary (rope.dimension_count={rotary} of head_dim {head_dim}) is not "
                         "supported")
    cfg = {"num_hidden_layers": int(key("block_count")), "max_position_embeddings": int(key("context_length", 4096)),
           "sliding_window": key("attention.sliding_window") or None}
    window, sliding = sliding_window_from_hf(cfg, "phi3")
    return {"sliding_window": window, "sliding_layers": sliding}


def split_fused(tensor: ReaderTensor, gguf_arch: str, q_size: int, kv_size: int
                ) -> list[tuple[str, ReaderTensor]] | None:
    """Phi-3's ``attn_qkv`` as q_proj / k_proj / v_proj and ``ffn_up`` as gate_proj / up_proj (Hugging Face names),
    each a row range of the tensor; None for any other tensor."""
    if gguf_arch != "phi3" or (m := _FUSED.fullmatch(tensor.name)) is None:
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
