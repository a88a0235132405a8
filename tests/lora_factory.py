"""Tiny random checkpoints and PEFT LoRA adapters for them, written by the tests (no model hub).

The adapters are made by the ``peft`` package itself (``get_peft_model`` + ``save_pretrained``), so their folders
are exactly what a user's PEFT training run writes: ``adapter_config.json`` + ``adapter_model.safetensors``.
``init_lora_weights=False`` gives both A and B random values (PEFT's default zeroes B, which would make an adapter
that changes nothing and a test that cannot fail).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def make_tiny_model(arch: str = "llama", seed: int = 1, **config: object) -> PreTrainedModel:
    """A tiny random model: ``llama`` (GQA, untied lm_head) or ``qwen2`` (q/k/v bias, tied embeddings);
    ``config`` overrides fields of the config (a real tokenizer's vocab_size and special tokens, say)."""
    torch.manual_seed(seed)
    if arch == "llama":
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "tie_word_embeddings": False, **config}))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{**_COMMON, "tie_word_embeddings": True, **config}))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    # transformers' init gives near-uniform logits, which hide errors and tie the top-k: spread them out.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.5 * noise if "embed" in name else 0.08 * noise)
    return model.eval()


def save_tiny_model(path: Path, arch: str = "llama", seed: int = 1) -> PreTrainedModel:
    """Write a tiny random checkpoint (config.json + safetensors) to ``path``; returns the model (eval mode)."""
    model = make_tiny_model(arch, seed)
    model.save_pretrained(path)
    return model


def save_adapter(base: PreTrainedModel, path: Path, *, r: int = 8, alpha: int = 16,
                 targets: Sequence[str] = ALL_TARGETS, seed: int = 2, use_rslora: bool = False,
                 scale: float = 0.1) -> PeftModel:
    """Write a random PEFT LoRA adapter for ``base`` to ``path``; returns the PeftModel (eval mode), whose
    forward is the reference. ``base`` itself is left unchanged (PEFT wraps a copy)."""
    import copy

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        use_rslora=use_rslora, init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # large enough to move the logits well past the tests' tolerances
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(path)
    return peft_model.eval()
