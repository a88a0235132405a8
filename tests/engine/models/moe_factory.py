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

VARIANTS: dict[str, Callable[[], PreTrainedModel]] = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        **_BASE, num_key_value_heads=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    # a shared expert with its sigmoid gate, q/k/v bias, a dense layer (mlp_only_layers), top-k not renormalised
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **_BASE, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    # q/k norm, renormalised top-k, every other layer sparse (decoder_sparse_step)
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_BASE, num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True)),
    # V2-Lite's shape: no q LoRA, greedy softmax top-k, a dense first layer, 2 shared experts
    "deepseek_v2_lite": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(
        **_BASE, **_MLA, q_lora_rank=None, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
        routed_scaling_factor=1.0)),
    # V2: q LoRA, group-limited greedy routing, a routed scaling factor
    "deepseek_v2": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(
        **_BASE, **_MLA, q_lora_rank=24, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    # V3 / R1 / Kimi-K2: sigmoid noaux_tc with the correction bias over groups, renormalised, scaled
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        **_BASE, **_MLA, q_lora_rank=24, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5)),
}


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


def build(kind: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = VARIANTS[kind]().eval()
    randomize(model, seed + 1)
    return model


def write_checkpoint(kind: str, path: Path, seed: int = 0, **config_changes: Any) -> tuple[PreTrainedModel, Path]:
    """The model (float32, eval) and its directory, with a tokenizer of VOCAB words ``w0`` .. ``w127``."""
    model = build(kind, seed)
    for key, value in config_changes.items():
        setattr(model.config, key, value)
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    return model, path


def greedy_reference(model: PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy continuation (no eos stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
