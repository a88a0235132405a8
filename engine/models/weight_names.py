"""Where each tensor of a Hugging Face checkpoint goes in our models, whose layout fuses some of them: q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj`` (the dense MLP's and the shared experts'), and every routed expert of a
layer into two stacked parameters, ``mlp.experts.w13`` ([experts, 2 * intermediate, hidden]: expert e's gate rows,
then its up rows) and ``mlp.experts.w2`` ([experts, hidden, intermediate]). A tensor lands in *part* ``p`` of its
parameter: q/k/v are parts 0/1/2, gate/up 0/1, expert e's gate/up parts 2e/2e+1 of w13 and its down part e of w2.

Names are the hub's: ``mlp.experts.{e}.gate_proj`` (Qwen-MoE, DeepSeek), Mixtral's ``block_sparse_moe.experts.{e}.w1``
/ ``w3`` / ``w2`` (gate / up / down) and ``block_sparse_moe.gate``, DeepSeek's ``shared_experts`` and
``gate.e_score_correction_bias``, Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate``. Models with latent
attention keep their projections as named (nothing fused).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from engine.models.config import ModelConfig
from engine.models.sharding import EXPERT, Shard, ShardPlan

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
# The part of a tensor that fills every part of its fused parameter at once.
ALL_PARTS = -1
# GLM-4's four norms by their places in our sandwich layout (Gemma's names): after attention, before and after the
# MLP.
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
               "post_attention_layernorm": "pre_feedforward_layernorm",
               "post_mlp_layernorm": "post_feedforward_layernorm"}


def map_name(hf_name: str, config: ModelConfig) -> tuple[str, int] | None:
    """HF checkpoint name -> (our parameter name, with the model's layer index; part of a fused parameter, expert
    parts by global expert id), or None to skip."""
    name = hf_name.removeprefix("model.")
    if name.startswith("rotary_emb.") or ".rotary_emb." in name:
        return None  # some old checkpoints store inv_freq; ours is recomputed
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # tied checkpoints sometimes still carry a copy
    if config.architecture == "glm4" and (norm := name.split(".")[2:3]) and norm[0] in _GLM4_NORMS:
        name = name.replace(f".{norm[0]}.", f".{_GLM4_NORMS[norm[0]]}.")
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.correction_bias"), 0
    if (m := EXPERT.search(name)) is not None:
        expert, proj = int(m.group(1)), m.group(2)
        prefix = name[:m.start()]
        if proj in ("down_proj", "w2"):
            return f"{prefix}mlp.experts.w2", expert
        return f"{prefix}mlp.experts.w13", 2 * expert + _EXPERT_PART[proj]
    name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
    if ".self_attn.qkv_proj." in name or ".mlp.gate_up_proj." in name:
        return name, ALL_PARTS   # fused in the checkpoint already (Phi-3)
    if config.mla is None:
        for part, index in _QKV.items():
            if f".self_attn.{part}." in name:
                return name.replace(part, "qkv_proj"), index
    for part, index in _GATE_UP.items():
        for owner in (".mlp.", ".mlp.shared_experts."):
            if f"{owner}{part}." in name:
                return name.replace(f"{owner}{part}.", f"{owner}gate_up_proj."), index
    return name, 0


def num_parts(param_name: str, plan: ShardPlan) -> int:
    if ".qkv_proj." in param_name:
        return 3
    if ".gate_up_proj." in param_name:
        return 2
    if param_name.endswith(".mlp.experts.w13"):
        return 2 * plan.experts[1]
    if param_name.endswith(".mlp.experts.w2"):
        return plan.experts[1]
    return 1


def local_part(param_name: str, part: int, plan: ShardPlan) -> int:
    """A part index as this rank numbers it (its first expert is its expert 0)."""
    if part == ALL_PARTS:
        return part
    if param_name.endswith(".mlp.experts.w13"):
        return part - 2 * plan.experts[0]
    if param_name.endswith(".mlp.experts.w2"):
        return part - plan.experts[0]
    return part


def part_view(param: torch.Tensor, name: str, part: int, plan: ShardPlan) -> torch.Tensor:
    """The rows of (local) part ``part`` of a fused parameter (this rank's sizes); ``ALL_PARTS``: all of it."""
    if part == ALL_PARTS:
        return param
    if ".qkv_proj." in name:
        sizes = [plan.q_size, plan.kv_size, plan.kv_size]
        return param.narrow(0, sum(sizes[:part]), sizes[part])
    if ".gate_up_proj." in name:
        half = param.shape[0] // 2
        return param.narrow(0, part * half, half)
    if name.endswith(".mlp.experts.w13"):
        half = param.shape[1] // 2
        return param[part // 2].narrow(0, (part % 2) * half, half)
    if name.endswith(".mlp.experts.w2"):
        return param[part]
    return param


def split_fused(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                shard_of: Callable[[str], Shard | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's fused ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` tensors (Phi-3, GLM; read whole) as the
    q/k/v and gate/up tensors they hold, each cut to this rank's ``shard_of`` its unfused name, so that fused
    checkpoints shard over tensor ranks as unfused ones do. Every tensor of such a projection (weight, bias, a
    per-channel scale) is cut along its rows; the other tensors pass as they are."""
    qkv = [config.q_size, config.kv_size, config.kv_size]
    for name, tensor in weights:
        parts: tuple[str, ...]
        if ".self_attn.qkv_proj." in name:
            parts, sizes = ("q_proj", "k_proj", "v_proj"), qkv
            fused = "qkv_proj"
        elif ".mlp.gate_up_proj." in name and ".mlp.experts." not in name:
            parts, sizes = ("gate_proj", "up_proj"), [tensor.shape[0] // 2] * 2
            fused = "gate_up_proj"
        else:
            yield name, tensor
            continue
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {' + '.join(map(str, sizes))} "
                             f"({', '.join(parts)})")
        for part, piece in zip(parts, tensor.split(sizes), strict=True):
            part_name = name.replace(f".{fused}.", f".{part}.")
            if (shard := shard_of(part_name)) is not None:
                yield part_name, shard.take(piece)
