"""A tiny random Llama checkpoint (float32) for engine tests that run real steps in a fraction of a second."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_tiny_llama(path: Path, seed: int = 1, vocab_size: int = 128) -> LlamaForCausalLM:
    """Write the checkpoint to ``path`` and return the transformers model (eval mode) that matches it."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    # transformers' init gives near-uniform logits, which hide errors and tie the top-k: spread them out.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.5 * noise if "embed" in name else 0.08 * noise)
    model.save_pretrained(path)
    return model.eval()
