"""The mixture-of-experts and latent-attention parts of a llama.cpp GGUF file: Mixtral (arch ``llama`` with
``llama.expert_count``), ``qwen2moe``, ``qwen3moe`` and ``deepseek2`` (DeepSeek-V2, V2-Lite, V3).

The metadata is read back into the ``config.json`` keys that ``engine.models.moe_config`` parses, so a GGUF file and
the checkpoint it was converted from give the same config and the same refusals. Where llama.cpp's metadata does not
keep what the Hugging Face config said, the tensors do: the layers with experts are those with a router
(``ffn_gate_inp``; the rest have a dense ``ffn_gate``/``ffn_up``/``ffn_down``), and a DeepSeek file is V3 (noaux_tc
routing) when its routers carry ``exp_probs_b``, the correction bias. A V2 file routes group-limited when it has more
than one expert group, as llama.cpp reads it.

llama.cpp stacks a layer's routed experts into 3-D tensors (``ffn_{gate,up,down}_exps``, [experts, rows, columns]
in torch order; gate and up fused as ``ffn_gate_up_exps`` by ``--fuse-gate-up-exps``; one ``ffn_gate.{e}`` per
expert in early Mixtral files). They are handed over one expert at a time under the hub's per-expert names, a view of
the stacked tensor each, so ``load_weights`` places, checks and shards them as it does a safetensors checkpoint's.
Newer converters split DeepSeek's ``kv_b_proj`` into ``attn_k_b`` (per head, transposed: [heads, kv_lora_rank,
qk_nope]) and ``attn_v_b`` ([heads, v_head_dim, kv_lora_rank]); ``join_latent_up`` puts it back together.
DeepSeek's rotary dimensions need no reordering: llama.cpp rotates adjacent pairs for ``deepseek2``, as the hub's
checkpoints lay them out.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
from gguf import ReaderTensor

# Reads ``{arch}.<name>`` from the file's metadata, or the default.
MetadataKey = Callable[..., Any]

MOE_GGUF_ARCHITECTURES = ("qwen2moe", "qwen3moe", "deepseek2")

# Per-layer tensors of the MoE and latent-attention models that map one to one onto a Hugging Face tensor.
MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
CORRECTION_BIAS = "exp_probs_b"   # blk.N.exp_probs_b.bias: DeepSeek-V3's gate.e_score_correction_bias

_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight")
_PER_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_LATENT_SPLIT = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")
_GATING = {1: "softmax", 2: "sigmoid"}   # gguf.ExpertGatingFuncType


def moe_architecture(gguf_arch: str, key: MetadataKey, tensor_names: Collection[str]) -> str | None:
    """The Hugging Face ``model_type`` of a mixture-of-experts file; None for a dense one."""
    if gguf_arch == "llama":
        return "mixtral" if int(key("expert_count", 0) or 0) > 0 else None
    if gguf_arch in ("qwen2moe", "qwen3moe"):
        return gguf_arch.replace("moe", "_moe")
    if gguf_arch == "deepseek2":
        return "deepseek_v3" if any(_is_correction_bias(n) for n in tensor_names) else "deepseek_v2"
    return None


def _is_correction_bias(name: str) -> bool:
    return name.endswith(f".{CORRECTION_BIAS}.bias")


def hf_config(arch: str, gguf_arch: str, key: MetadataKey, tensor_names: Collection[str]) -> dict[str, Any]:
    """The ``config.json`` keys of ``arch`` that ``moe_from_hf`` and ``mla_from_hf`` read, from the file."""
    layers = int(key("block_count"))
    cfg: dict[str, Any] = {"model_type": arch, "num_hidden_layers": layers,
                           "num_experts_per_tok": int(key("expert_used_count"))}
    experts = int(key("expert_count", 0) or 0)
    gating = key("expert_gating_func")
    if gating is not None and int(gating) not in _GATING:
        raise ValueError(f"{gguf_arch}.expert_gating_func={int(gating)} is not supported (1: softmax, 2: sigmoid)")
    if arch == "mixtral":
        cfg.update(num_local_experts=experts, intermediate_size=int(key("feed_forward_length")))
        return cfg
    cfg["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    if arch in ("qwen2_moe", "qwen3_moe"):
        cfg.update(num_experts=experts,
                   mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
                   shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0) or 0),
                   # llama.cpp's qwen3moe always renormalises the top-k weights, its qwen2moe only when told
                   norm_topk_prob=bool(key("expert_weights_norm", arch == "qwen3_moe")))
        return cfg
    # DeepSeek: llama.cpp reads a file without a gating function as softmax (the V2 files written before it)
    scoring = _GATING[int(gating)] if gating is not None else "softmax"
    groups, groups_used = key("expert_group_count"), key("expert_group_used_count")
    grouped = groups is not None and int(groups) > 1
    if grouped and groups_used is None:
        raise ValueError(f"{gguf_arch}.expert_group_count={int(groups)} needs {gguf_arch}.expert_group_used_count")
    q_lora = key("attention.q_lora_rank")
    rope = int(key("rope.dimension_count"))
    # Newer converters write the latent sizes as key/value_length and the heads' as key/value_length_mla.
    qk_head = int(key("attention.key_length_mla") or key("attention.key_length"))
    v_head = int(key("attention.value_length_mla") or key("attention.value_length"))
    cfg.update(n_routed_experts=experts, n_shared_experts=int(key("expert_shared_count", 0) or 0),
               first_k_dense_replace=int(key("leading_dense_block_count", 0) or 0),
               routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
               norm_topk_prob=bool(key("expert_weights_norm", False)), scoring_func=scoring,
               topk_method=("noaux_tc" if arch == "deepseek_v3" else
                            "group_limited_greedy" if grouped else "greedy"),
               n_group=int(groups) if groups is not None else None,
               topk_group=int(groups_used) if groups_used is not None else None,
               kv_lora_rank=int(key("attention.kv_lora_rank")), q_lora_rank=int(q_lora) if q_lora else None,
               qk_rope_head_dim=rope, qk_nope_head_dim=qk_head - rope, v_head_dim=v_head)
    return cfg


def _expert_view(tensor: ReaderTensor, expert: int, rows: slice | None = None) -> ReaderTensor:
    """Expert ``expert``'s matrix of a stacked tensor (``rows`` of it), as a 2-D tensor of the same type: the
    loader's readers (row and column shards, blocks) take it as they take any matrix."""
    data = tensor.data[expert]
    shape = [int(tensor.shape[0]), int(tensor.shape[1])]   # GGUF order: columns, rows
    if rows is not None:
        data = data[rows]
        shape[1] = rows.stop - rows.start
    elements = shape[0] * shape[1]
    return tensor._replace(name=f"{tensor.name}[{expert}]", shape=np.array(shape, dtype=np.uint32),
                           n_elements=elements, n_bytes=int(data.nbytes), data=data)


def expert_parts(tensor: ReaderTensor) -> list[tuple[str, ReaderTensor]] | None:
    """The per-expert tensors (Hugging Face names) of a stacked or per-expert GGUF tensor; None for another."""
    if (m := _PER_EXPERT.fullmatch(tensor.name)) is not None:
        layer, proj, expert = m.groups()
        return [(_expert_name(int(layer), int(expert), proj), tensor)]
    if (m := _STACKED.fullmatch(tensor.name)) is None:
        return None
    layer, proj = int(m.group(1)), m.group(2)
    if len(tensor.shape) != 3:
        raise ValueError(f"GGUF tensor {tensor.name!r} has shape {tensor.shape.tolist()}; expected 3 dimensions "
                         "(columns, rows, experts)")
    experts = int(tensor.shape[2])
    if proj != "gate_up":
        return [(_expert_name(layer, e, proj), _expert_view(tensor, e)) for e in range(experts)]
    half = int(tensor.shape[1]) // 2   # fused: each expert's gate rows, then its up rows
    return [part for e in range(experts) for part in (
        (_expert_name(layer, e, "gate"), _expert_view(tensor, e, slice(0, half))),
        (_expert_name(layer, e, "up"), _expert_view(tensor, e, slice(half, 2 * half))))]


def _expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def latent_split(name: str) -> tuple[int, str] | None:
    """(layer, "k" or "v") of a split DeepSeek up projection (``attn_k_b`` / ``attn_v_b``); None for another."""
    m = _LATENT_SPLIT.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m is not None else None


def latent_up_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def join_latent_up(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """``kv_b_proj`` [heads * (qk_nope + v), kv_lora_rank] from llama.cpp's split halves: ``k_b`` [heads,
    kv_lora_rank, qk_nope] (each head's key rows, transposed) and ``v_b`` [heads, v, kv_lora_rank]."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"attn_k_b {k_b.shape} and attn_v_b {v_b.shape} are not the halves of one kv_b_proj")
    joined = np.concatenate((k_b.swapaxes(1, 2), v_b), axis=1)
    return joined.reshape(-1, joined.shape[2])
