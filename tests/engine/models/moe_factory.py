"""Tiny random mixture-of-experts checkpoints written by transformers in the hub's per-expert layout (transformers 5
keeps experts fused in memory and writes ``mlp.experts.{e}.gate_proj`` / Mixtral's ``w1``/``w3``/``w2`` on save),
with a word-level tokenizer so the engine and the offline API load them. Sizes divide over 2 ranks (heads, experts,
intermediate sizes)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 128
_BASE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                             max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=False)
_MLA: dict[str, Any] = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            num_key_value_heads=4)

# kind -> (model class, config class, config arguments)
_KINDS: dict[str, tuple[type[PreTrainedModel], Any, dict[str, Any]]] = {
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(
        **_BASE, num_key_value_heads=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    # a shared expert with its sigmoid gate, q/k/v bias, a dense layer (mlp_only_layers), top-k not renormalised
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        **_BASE, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    # q/k norm, renormalised top-k, every other layer sparse (decoder_sparse_step)
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        **_BASE, num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True)),
    # V2-Lite's shape: no q LoRA, greedy softmax top-k, a dense first layer, 2 shared experts
    "deepseek_v2_lite": (DeepseekV2ForCausalLM, DeepseekV2Config, dict(
        **_BASE, **_MLA, q_lora_rank=None, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
        routed_scaling_factor=1.0)),
    # V2: q LoRA, group-limited greedy routing, a routed scaling factor
    "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config, dict(
        **_BASE, **_MLA, q_lora_rank=24, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    # V3 / R1 / Kimi-K2: sigmoid noaux_tc with the correction bias over groups, renormalised, scaled
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config, dict(
        **_BASE, **_MLA, q_lora_rank=24, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
}


def _variant(kind: str) -> Callable[..., PreTrainedModel]:
    model_cls, config_cls, kwargs = _KINDS[kind]
    return lambda **changes: model_cls(config_cls(**{**kwargs, **changes}))


# kind -> a constructor of the model (keyword arguments change its config)
VARIANTS: dict[str, Callable[..., PreTrainedModel]] = {kind: _variant(kind) for kind in _KINDS}


def randomize(model: PreTrainedModel, seed: int) -> None:
    """transformers' init gives near-uniform logits and a near-uniform router that hide errors: spread everything,
    the routers most (so top-k choices are clear-cut), and give DeepSeek-V3's correction bias values that change
    which experts win."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1 + 0.2 * noise)
            elif "embed" in name:
                param.copy_(0.5 * noise)
            elif name.endswith(("gate.weight", "block_sparse_moe.gate.weight")) and param.dim() == 2:
                param.copy_(0.5 * noise)   # the router
            else:
                param.copy_(0.08 * noise)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))


def build(kind: str, seed: int = 0, **config: Any) -> PreTrainedModel:
    """A randomized model of ``kind`` (``config``: changes to its config arguments, e.g. vocab_size)."""
    torch.manual_seed(seed)
    model = VARIANTS[kind](**config).eval()
    randomize(model, seed + 1)
    return model


def write_checkpoint(kind: str, path: Path, seed: int = 0, **config_changes: Any) -> tuple[PreTrainedModel, Path]:
    """The model (float32, eval) and its directory, with a tokenizer of VOCAB words ``w0`` .. ``w127``."""
    model = build(kind, seed)
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    model.save_pretrained(path)
    write_tokenizer(path)
    return model, path


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer of VOCAB words ``w0`` .. ``w127`` into checkpoint directory ``path``."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))


def greedy_reference(model: PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy continuation (no eos stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def write_mtp(model: PreTrainedModel, path: Path, seed: int = 7) -> Any:
    """Random multi-token prediction layer weights for a DeepSeek-V3 ``model`` written into its checkpoint at
    ``path`` in the hub's layout (``model.layers.{L}.enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``,
    the decoder block's tensors under the same prefix with per-expert names, and the layer's own copies of the
    embedding and lm_head, as DeepSeek-V3's checkpoints carry them), in a file of their own. Returns transformers'
    ``MtpModel`` holding the same weights: the reference."""
    from safetensors.torch import save_file
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(model, 1).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in mtp.named_parameters():
            if not name.startswith("layers."):
                continue   # the embedding and head are the main model's
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else
                        (0.5 if name.endswith("mlp.gate.weight") else 0.08) * noise)
        for name, buf in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    first = model.config.num_hidden_layers
    prefix = f"model.layers.{first}."
    tensors: dict[str, torch.Tensor] = {}
    state = {**dict(mtp.named_parameters()), **dict(mtp.named_buffers())}
    for name, value in state.items():
        if not name.startswith("layers.0."):
            continue
        rest = name.removeprefix("layers.0.")
        value = value.detach().contiguous()
        if rest == "post_norm.weight":
            tensors[prefix + "shared_head.norm.weight"] = value
        elif rest == "mtp_block.mlp.experts.gate_up_proj":
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :half].contiguous()
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, half:].contiguous()
        elif rest == "mtp_block.mlp.experts.down_proj":
            for e in range(value.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            tensors[prefix + rest.removeprefix("mtp_block.")] = value
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, str(path / "mtp.safetensors"))
    return mtp
