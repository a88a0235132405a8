"""Loading a llama.cpp GGUF file: config from its metadata, tensors dequantized to the model dtype.

llama.cpp's converter permutes the rows of Llama's Q and K projections (to its interleaved RoPE
layout); ``unpermute_qk`` restores the Hugging Face layout, which our rotate_half RoPE expects.
Qwen2/Qwen3 files are written unpermuted, and without a sliding window (llama.cpp reads none for them: a window key
there is ignored, as llama.cpp ignores it). Gemma 2, Gemma 3, Phi-3 and GLM-4 files (their norms, windows, partial
and LongRoPE rotary, and fused projections) are read by ``engine.models.gguf_families``; Mixtral, Qwen-MoE and
DeepSeek files (their experts, routers and latent attention) by ``engine.models.gguf_moe``. A tensor the loader has
no place for is refused, naming it, and so is an architecture it does not know.

A tensor-parallel rank reads its shard alone from the memory-mapped file: whole rows of a block-quantized
tensor, or whole blocks of its columns (when the shard's columns start and end on block boundaries; otherwise
the rows are dequantized and cut). The permutation stays within each head, and shards hold whole heads, so a
shard is un-permuted by its own head count.
"""
from __future__ import annotations

import functools
import re
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from engine.distributed import ParallelContext
from engine.models import gguf_families, gguf_kquants, gguf_moe, quant
from engine.models.config import ModelConfig, RopeScaling, merge_eos
from engine.models.int4 import Int4Weight
from engine.models.llama import CausalLM, build_model
from engine.models.moe_config import mla_from_hf, moe_from_hf
from engine.models.sharding import EXPERT, Shard

_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", **gguf_families.ARCHITECTURES}
_SUPPORTED = (*_ARCHITECTURES, *gguf_moe.MOE_GGUF_ARCHITECTURES)
# Tensors read into the config, not loaded as weights.
_CONFIG_TENSORS = ("rope_freqs.weight", *gguf_families.ROPE_FACTORS)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **gguf_moe.MOE_LAYER_NAMES,
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor of architecture ``gguf_arch``, or None for tensors we do
    not load."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is not None and m.group(2) == gguf_moe.CORRECTION_BIAS and m.group(3) == "bias":
        return f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"
    if m is None:
        return None
    layer_name = gguf_families.LAYER_NAMES.get(gguf_arch, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return None if layer_name is None else f"model.layers.{m.group(1)}.{layer_name}.{m.group(3)}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: within each head, rows were reordered from
    [first half | second half] to interleaved pairs; put them back."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


class ModelReader(GGUFReader):
    """gguf's reader without the vocabulary. GGUFReader makes a numpy view of every array element: ~10^5 for a
    vocabulary's tokens, merges and token types, seconds of every engine start (the tokenizer reads them with
    engine.text's own reader). Here arrays of strings are skipped and left out of ``fields``; arrays of numbers
    are one view each (``contents()`` of the whole array as before). Tensors are read as gguf reads them."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        for name in [name for name, f in self.fields.items() if f.types == [GGUFValueType.ARRAY, GGUFValueType.STRING]]:
            del self.fields[name]

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int],
                                                                        list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":   # scalars; a file of the other byte order
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype = GGUFValueType(raw_itype[0])
        offs = orig_offs + 12
        if itype == GGUFValueType.STRING:   # skipped: each is a uint64 length and its bytes
            data = self.data.data   # a memoryview of the map
            for _ in range(int(count[0])):
                offs += 8 + struct.unpack_from("<Q", data, offs)[0]
            return offs - orig_offs, [raw_itype, count], [], [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:   # arrays of arrays: gguf's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, int(count[0]))
        return 12 + int(values.nbytes), [raw_itype, count, values], [2], [GGUFValueType.ARRAY, itype]


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def tensor_to_numpy(tensor: ReaderTensor) -> np.ndarray:
    """Dequantized float array in torch (row-major) order: GGUF lists dims innermost first."""
    array = dequantize(tensor.data, tensor.tensor_type)
    return array.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch not in _SUPPORTED:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(_SUPPORTED)}")
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{gguf_arch}.{name}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    moe_arch = gguf_moe.moe_architecture(gguf_arch, key, tensors)
    moe = mla = None
    if moe_arch is not None:   # read as the Hugging Face config it was converted from
        hf_cfg = gguf_moe.hf_config(moe_arch, gguf_arch, key, tensors)
        moe, mla = moe_from_hf(hf_cfg, moe_arch), mla_from_hf(hf_cfg, moe_arch)
    if mla is not None:   # llama.cpp writes MLA as one key-value head of the latent's width
        num_kv_heads, head_dim = num_heads, mla.qk_head_dim
    vocab = key("vocab_size") or int(tensors["token_embd.weight"].shape[1])
    family = gguf_families.config_fields(gguf_arch, key, tensors)
    # Phi-3's LongRoPE comes with the family's fields
    scaling = family.pop("rope_scaling") if "rope_scaling" in family else _rope_scaling(gguf_arch, key, tensors)
    # Llama 3.1 files carry their RoPE scaling as per-frequency divisors in a tensor.
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = tuple(float(v) for v in tensor_to_numpy(tensors["rope_freqs.weight"]).reshape(-1))
    bias = "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors
    eos = tuple(int(v) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
                if (v := _field(reader, f"tokenizer.ggml.{k}")) is not None)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=moe_arch or _ARCHITECTURES[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=bias,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=merge_eos(eos),
        rope_freq_factors=freq_factors,
        moe=moe,
        mla=mla,
        **family,
    )


def _rope_scaling(gguf_arch: str, key: gguf_families.Key, tensors: dict[str, ReaderTensor]) -> RopeScaling | None:
    """The file's linear rope scaling, or none; other kinds refused."""
    if factors := [name for name in gguf_families.ROPE_FACTORS if name in tensors]:
        raise ValueError(f"GGUF tensor {factors[0]!r} (LongRoPE) is read for phi3 only, not {gguf_arch!r}")
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        return RopeScaling("linear", float(key("rope.scaling.factor")))
    if scaling_type != "none":
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    return None


def _permuted(name: str, config: ModelConfig) -> bool:
    """Whether a tensor's rows are permuted by head (llama.cpp's Llama and Mixtral q/k weights)."""
    return config.architecture in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight"))


def _column_bytes(tensor: ReaderTensor, shard: Shard) -> slice | None:
    """The byte columns of ``tensor.data`` holding the columns of ``shard`` (dim 1) when they are whole blocks of a
    byte-stored tensor; None otherwise."""
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    if tensor.data.dtype != np.uint8 or shard.start % block or shard.size % block:
        return None
    return slice(shard.start // block * type_size, (shard.start + shard.size) // block * type_size)


def read_tensor(tensor: ReaderTensor, shard: Shard) -> np.ndarray:
    """The ``shard`` of a tensor, dequantized to float32 in torch (row-major) order, reading only its rows or
    blocks where the format allows."""
    if shard.dim is None:
        return tensor_to_numpy(tensor)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    end = shard.start + shard.size
    if shard.dim == 0:
        return dequantize(tensor.data[shard.start:end], tensor.tensor_type).reshape(shard.size, *shape[1:])
    if (columns := _column_bytes(tensor, shard)) is not None:
        return dequantize(tensor.data[:, columns], tensor.tensor_type).reshape(shape[0], shard.size)
    if tensor.data.dtype != np.uint8:  # stored as elements (F32, F16)
        return dequantize(tensor.data[:, shard.start:end], tensor.tensor_type)
    return tensor_to_numpy(tensor)[:, shard.start:end]


def read_blocks(tensor: ReaderTensor, shard: Shard) -> quant.QuantWeight | None:
    """The ``shard`` of a block-quantized matrix as blocks; None when its columns do not fall on block boundaries
    (that layer then runs dense)."""
    raw = tensor.data
    if shard.dim == 0:
        raw = raw[shard.start:shard.start + shard.size]
    elif shard.dim == 1:
        columns = _column_bytes(tensor, shard)
        if columns is None:
            return None
        raw = raw[:, columns]
    return quant.from_gguf_blocks(raw, tensor.tensor_type)


Sources = tuple[list[tuple[str, ReaderTensor]], list[tuple[str, ReaderTensor, ReaderTensor]]]


def model_tensors(reader: GGUFReader, config: ModelConfig) -> Sources:
    """Every tensor the model loads under its Hugging Face name (a stacked tensor's experts, a fused tensor's parts
    one view each), and DeepSeek's split latent up projections as (name, attn_k_b, attn_v_b). Raises ValueError
    naming a tensor the loader has no place for (its weights would otherwise be silently dropped)."""
    gguf_arch = str(_field(reader, "general.architecture"))
    named: list[tuple[str, ReaderTensor]] = []
    halves: dict[int, dict[str, ReaderTensor]] = {}
    for tensor in reader.tensors:
        if (fused := gguf_families.split_fused(tensor, gguf_arch, config.q_size, config.kv_size)) is not None:
            named.extend(fused)
        elif (name := hf_name(tensor.name, gguf_arch)) is not None:
            named.append((name, tensor))
        elif (parts := gguf_moe.expert_parts(tensor)) is not None:
            named.extend(parts)
        elif (split := gguf_moe.latent_split(tensor.name)) is not None:
            halves.setdefault(split[0], {})[split[1]] = tensor
        elif tensor.name not in _CONFIG_TENSORS:
            raise ValueError(f"GGUF tensor {tensor.name!r} is not supported: the loader has no place for it")
    latent = []
    for layer, pair in sorted(halves.items()):
        if set(pair) != {"k", "v"}:
            raise ValueError(f"GGUF layer {layer} has attn_{''.join(pair)}_b without its other half "
                             "(attn_k_b and attn_v_b together make kv_b_proj)")
        latent.append((gguf_moe.latent_up_name(layer), pair["k"], pair["v"]))
    return named, latent


def _iter_tensors(reader: GGUFReader, model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of every tensor the model loads."""
    named, latent = model_tensors(reader, model.config)
    wanted = [(t, name, shard) for name, t in named if (shard := model.weight_shard(name)) is not None]
    config = model.config
    for tensor, name, shard in tqdm(wanted, desc="Loading GGUF", unit="tensor", file=sys.stderr, leave=False):
        array = read_tensor(tensor, shard)
        if _permuted(name, config):
            array = unpermute_qk(array, array.shape[0] // config.head_dim)
        if array.ndim == 1 and name.endswith(".mlp.shared_expert_gate.weight"):   # llama.cpp drops its row axis
            array = array.reshape(1, -1)
        if not array.flags.writeable:  # F32 tensors are views of the read-only memory map
            array = array.copy()
        yield name, torch.from_numpy(array)
    for name, k_b, v_b in latent:
        if (shard := model.weight_shard(name)) is not None:
            joined = gguf_moe.join_latent_up(tensor_to_numpy(k_b), tensor_to_numpy(v_b))
            yield name, shard.take(torch.from_numpy(joined))


def _iter_quantized(reader: GGUFReader, model: CausalLM) -> Iterator[tuple[str, quant.QuantWeight]]:
    """This rank's part of the Q4_0 / Q4_1 / Q8_0 matrices as blocks (engine.models.quant), rows in Hugging Face
    order. Routed experts are not among them (the fused experts run on their dequantized weights)."""
    config = model.config
    for name, tensor in model_tensors(reader, config)[0]:
        if len(tensor.shape) != 2 or not quant.supported(tensor.tensor_type) or EXPERT.search(name) is not None:
            continue
        shard = model.weight_shard(name)
        weight = read_blocks(tensor, shard) if shard is not None else None
        if weight is None:
            continue
        if _permuted(name, config):
            heads = weight.shape[0] // config.head_dim
            weight = quant.permute_rows(weight, lambda a, h=heads: unpermute_qk(a, h))
        yield name, weight


def _iter_q4_k(reader: GGUFReader, model: CausalLM) -> Iterator[tuple[str, Int4Weight]]:
    """This rank's part of the Q4_K matrices as group-32 4-bit weights (engine.models.gguf_kquants), rows in Hugging
    Face order; a column shard that would split a sub-block of 32 is left out (that layer runs dense)."""
    config = model.config
    for name, tensor in model_tensors(reader, config)[0]:
        shard = model.weight_shard(name)
        if (tensor.tensor_type != gguf_kquants.Q4_K or len(tensor.shape) != 2 or shard is None
                or EXPERT.search(name) is not None):
            continue
        if shard.dim == 1 and (shard.start % gguf_kquants.SUB_BLOCK or shard.size % gguf_kquants.SUB_BLOCK):
            continue
        rows = tensor.data[shard.start:shard.start + shard.size] if shard.dim == 0 else tensor.data
        weight = gguf_kquants.q4_k_weight(rows)
        if shard.dim == 1:
            weight = weight.take(shard, name)
        if _permuted(name, config):
            heads = weight.shape[0] // config.head_dim
            weight = gguf_kquants.permute_rows(weight, functools.partial(unpermute_qk, num_heads=heads))
        yield name, weight


def load_gguf_model(path: Path, dtype: torch.dtype, device: torch.device | str = "cpu",
                    parallel: ParallelContext = ParallelContext()) -> CausalLM:
    """Weights dequantized to ``dtype``; for float32 and bfloat16 on the CPU the model also keeps the quantized
    blocks (``CausalLM.load_quantized``) for the ``quant_linear`` kernel (the CPU device drops them
    when the kernels are off or cannot be built), and its Q4_K projections become 4-bit weights (their float copies
    freed; engine.models.gguf_kquants). ``parallel``: as ``load_model``."""
    reader = ModelReader(str(path))
    config = config_from_gguf(reader)
    model = build_model(config, dtype, device, parallel)
    model.load_weights(_iter_tensors(reader, model))
    if dtype in (torch.float32, torch.bfloat16) and torch.device(device).type == "cpu":
        model.load_quantized(_iter_quantized(reader, model))
        gguf_kquants.attach(model, _iter_q4_k(reader, model))
    return model
