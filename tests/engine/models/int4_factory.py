"""Tiny 4-bit checkpoints written from a random Llama by quantizing its projections here (round to nearest per
group) into each format's own packing, written from the formats' specifications independently of the engine's
unpacking: GPTQ (AutoGPTQ's ``QuantLinear`` layout, v1 and v2 zero points, act order with ``g_idx``), AWQ (AutoAWQ's
``WQLinear_GEMM`` packing order) and compressed-tensors ``pack-quantized`` (packed by compressed-tensors' own
``pack_to_int32``). Each writer returns the dequantized float32 weights, the reference the tests compare against."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The projections that read one input share an act-order permutation (GPTQ quantizes them from one Hessian).
_SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def save_float_llama(path: Path, seed: int = 3) -> LlamaForCausalLM:
    """A float32 Llama whose projections hold whole groups of 32 and 128 (hidden 128, MLP 256), untied lm_head, with
    a word-level tokenizer."""
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.5 * noise if "embed" in name else 0.08 * noise)
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))   # so that the offline API loads it
    return model.eval()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _quantize(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes [out, in] (0..15), float16 scales and integer zeros [out, groups]."""
    out, cols = w.shape
    groups = cols // group
    codes = torch.empty(out, cols, dtype=torch.int64)
    scales = torch.empty(out, groups)
    zeros = torch.empty(out, groups, dtype=torch.int64)
    for g in range(groups):
        cols_g = (g_idx == g).nonzero().flatten()
        wg = w[:, cols_g]
        if sym:
            scale = (2 * wg.abs().amax(1) / 15).clamp_min(1e-6)
            zero = torch.full((out,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp_max(0), wg.amax(1).clamp_min(0)
            scale = ((hi - lo) / 15).clamp_min(1e-6)
            zero = torch.round(-lo / scale).long().clamp(min_zero, 15)
        scale = scale.half().float()
        codes[:, cols_g] = torch.clamp(torch.round(wg / scale[:, None]) + zero[:, None], 0, 15).long()
        scales[:, g], zeros[:, g] = scale, zero
    return codes, scales, zeros


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    return (codes.float() - zeros[:, g_idx].float()) * scales[:, g_idx]


def gptq_config(group: int, desc_act: bool = False, sym: bool = True, v2: bool = False, bits: int = 4
                ) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "lm_head": False,
            "checkpoint_format": "gptq_v2" if v2 else "gptq"}


def awq_config(group: int, version: str = "gemm") -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": version,
            "modules_to_not_convert": None}


def ct_config(group: int) -> dict[str, Any]:
    strategy = {"strategy": "channel", "group_size": None} if group == -1 else {"strategy": "group",
                                                                               "group_size": group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "pack-quantized",
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
                            "observer": "minmax", "block_structure": None, **strategy},
                "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}


def write_int4(float_dir: Path, out: Path, qc: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """``float_dir``'s checkpoint with every projection packed as ``qc`` says; returns each projection's
    dequantized float32 weight by its ``.weight`` name (the reference)."""
    shutil.copytree(float_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    method = qc["quant_method"]
    if method == "compressed-tensors":
        group = qc["config_groups"]["group_0"]["weights"]["group_size"] or -1
        sym, v2, desc_act = True, True, False
    else:
        group, sym = qc["group_size"], qc.get("sym", method == "gptq")
        v2, desc_act = qc.get("checkpoint_format") == "gptq_v2", qc.get("desc_act", False)
        sym = sym if method == "gptq" else False
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        parts = name.split(".")
        lm_head = name == "lm_head.weight" and qc.get("lm_head", False)   # GPTQModel's quantized lm_head
        if not (name.endswith(".weight") and parts[-2] in PROJ) and not lm_head:
            continue
        base = name.removesuffix(".weight")
        w = tensors.pop(name).float()
        out_f, cols = w.shape
        size = cols if group == -1 else group
        if desc_act:
            key = (".".join(parts[:3]), _SAME_INPUT.get(parts[-2], parts[-2]))
            perm = perms.setdefault(key, torch.randperm(cols, generator=gen))
            g_idx = torch.empty(cols, dtype=torch.int64)
            g_idx[perm] = torch.arange(cols) // size
        else:
            g_idx = torch.arange(cols) // size
        # v1 stores zero - 1 in 4 bits, so it cannot hold a zero point of 0 (AutoGPTQ's limit that v2 lifts)
        codes, scales, zeros = _quantize(w, size, sym, g_idx, min_zero=1 if method == "gptq" and not v2 else 0)
        reference[name] = _dequantize(codes, scales, zeros, g_idx)
        if method == "gptq":
            tensors.update(_gptq_tensors(base, codes, scales, zeros, g_idx, v2))
        elif method == "awq":
            tensors.update(_awq_tensors(base, codes, scales, zeros))
        else:
            tensors[base + ".weight_packed"] = pack_to_int32((codes - 8).to(torch.int8), 4)
            tensors[base + ".weight_scale"] = scales.to(torch.bfloat16)
            tensors[base + ".weight_shape"] = torch.tensor([out_f, cols], dtype=torch.int64)
            reference[name] = (codes.float() - 8) * scales.to(torch.bfloat16).float()[:, g_idx]
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    return reference


def _gptq_tensors(base: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  g_idx: torch.Tensor, v2: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's packing: qweight [in / 8, out], input row 8i + j in bits 4j; qzeros [groups, out / 8], output
    column 8i + j in bits 4j, stored minus 1 in v1."""
    codes_t = codes.t()
    qweight = torch.zeros(codes_t.shape[0] // 8, codes_t.shape[1], dtype=torch.int64)
    for j in range(8):
        qweight |= codes_t[j::8] << (4 * j)
    stored = (zeros.t() if v2 else zeros.t() - 1)   # [groups, out]
    qzeros = torch.zeros(stored.shape[0], stored.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= (stored[:, j::8] & 0xF) << (4 * j)
    return {base + ".qweight": _to_int32(qweight), base + ".qzeros": _to_int32(qzeros),
            base + ".scales": scales.t().contiguous().half(), base + ".g_idx": g_idx.to(torch.int32)}


def _awq_tensors(base: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing: qweight [in, out / 8], nibble i of word j holding output column 8j + order[i];
    qzeros [groups, out / 8] the same way."""
    def pack(values: torch.Tensor) -> torch.Tensor:   # [rows, out] -> [rows, out / 8]
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            words |= values[:, col::8] << (4 * i)
        return _to_int32(words)

    return {base + ".qweight": pack(codes.t()), base + ".qzeros": pack(zeros.t()),
            base + ".scales": scales.t().contiguous().half()}


def reference_model(float_dir: Path, reference: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """transformers' Llama with the dequantized projection weights (float32): the dequantize-then-matmul model."""
    model = LlamaForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name, weight in reference.items():
            state[name].copy_(weight)
    return model.eval()


def write_dequantized(float_dir: Path, out: Path, reference: dict[str, torch.Tensor]) -> Path:
    """The float checkpoint holding the dequantized weights (for runs through the engine's float path)."""
    shutil.copytree(float_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update({k: v.contiguous() for k, v in reference.items()})
    save_file(tensors, str(out / "model.safetensors"))
    return out
