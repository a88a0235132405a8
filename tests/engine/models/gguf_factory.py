"""GGUF files of the dense families written from a transformers model as llama.cpp's convert_hf_to_gguf.py writes
them (Gemma2Model, Gemma3Model, Phi3MiniModel, Glm4Model): the metadata keys each converter sets, tensors under
gguf's names for the architecture, Gemma's norms stored as 1 + weight, Phi-3's LongRoPE as two factor tensors and
its attention factor, rope over part of each head as ``rope.dimension_count``."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import quantize
from transformers import PreTrainedModel

Q = gguf.GGMLQuantizationType
# our kind -> the converter's architecture
ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
        "glm4": gguf.MODEL_ARCH.GLM4}


@dataclasses.dataclass
class GgufFile:
    """What a converter writes: metadata (under the arch's prefix unless the key names its own) and tensors in
    torch order by GGUF name, matrices in ``qtype`` (vectors stay F32, as llama.cpp keeps them)."""

    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray]
    qtype: Q = Q.F32

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(str(path), arch=self.arch)
        for key, value in self.metadata.items():
            name = key if key.startswith(("tokenizer.", "general.")) else f"{self.arch}.{key}"
            if isinstance(value, bool):
                writer.add_bool(name, value)
            elif isinstance(value, int):
                writer.add_uint32(name, value)
            elif isinstance(value, float):
                writer.add_float32(name, value)
            elif isinstance(value, str):
                writer.add_string(name, value)
            else:
                writer.add_array(name, value)
        for name, array in self.tensors.items():
            array = np.ascontiguousarray(array, dtype=np.float32)
            if array.ndim == 1 or self.qtype == Q.F32:
                writer.add_tensor(name, array)
            elif self.qtype == Q.F16:
                writer.add_tensor(name, array.astype(np.float16))
            else:
                writer.add_tensor(name, quantize(array, self.qtype), raw_dtype=self.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def _phi3_metadata(cfg: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Phi3MiniModel's rope keys (``set_gguf_parameters``) and LongRoPE tensors (``generate_extra_tensors``)."""
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    rotary = int((rope.get("partial_rotary_factor") or 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    m: dict[str, Any] = {"rope.scaling.original_context_length": original, "rope.dimension_count": rotary,
                         "rope.freq_base": float(rope["rope_theta"]),
                         "attention.sliding_window": cfg.sliding_window or 0}
    if not rope.get("long_factor"):
        return m, {}
    scale = cfg.max_position_embeddings / original
    m["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    return m, {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
               "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}


def convert(hf: PreTrainedModel, kind: str) -> GgufFile:
    """The file convert_hf_to_gguf.py's converter for ``kind`` writes from ``hf``."""
    cfg = hf.config
    m: dict[str, Any] = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "tokenizer.ggml.bos_token_id": cfg.bos_token_id, "tokenizer.ggml.eos_token_id": cfg.eos_token_id,
    }
    extra: dict[str, np.ndarray] = {}
    if kind == "gemma2":
        m.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                  "attn_logit_softcapping": float(cfg.attn_logit_softcapping),
                  "final_logit_softcapping": float(cfg.final_logit_softcapping),
                  "attention.sliding_window": cfg.sliding_window})
    elif kind == "gemma3":
        full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        m.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                  "rope.freq_base": float(full["rope_theta"]), "rope.freq_base_swa": float(local["rope_theta"]),
                  "rope.scaling.type": "linear", "rope.scaling.factor": float(full["factor"]),
                  "final_logit_softcapping": float(cfg.final_logit_softcapping),
                  "attention.sliding_window": cfg.sliding_window})
    elif kind == "phi3":
        keys, extra = _phi3_metadata(cfg)
        m.update(keys)
    else:   # glm4: TextModel's keys, and the rotated part of each head (half unless the config says)
        rope = cfg.rope_parameters
        m.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                  "rope.freq_base": float(rope["rope_theta"]),
                  "rope.dimension_count": int(cfg.head_dim * rope.get("partial_rotary_factor", 0.5))})
    names = gguf.get_tensor_name_map(ARCH[kind], cfg.num_hidden_layers)
    tensors = dict(extra)   # the converter writes its generated tensors first
    for name, value in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = value.float().numpy()
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1   # Gemma's RMSNorm scales by 1 + weight: the converter stores the sum
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        tensors[new] = w
    return GgufFile(gguf.MODEL_ARCH_NAMES[ARCH[kind]], m, tensors)
