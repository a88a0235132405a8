"""Tiny random checkpoints written with transformers, with a word-level tokenizer so the offline API loads them,
and a look at a process's children (the ranks an executor started)."""
from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Sizes that divide over 2 tensor ranks (4 heads, 2 KV heads, 128 ids) and 2 pipeline stages (4 layers).
_COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=False)),       # GQA, untied
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=True)),        # q/k/v bias, tied
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False)),  # q/k norm
    # a sliding window of 8 positions in every layer
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=8, tie_word_embeddings=False)),
}


def write_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    """A checkpoint of ``kind`` whose weights are spread out (transformers' init gives near-uniform logits that
    hide errors)."""
    torch.manual_seed(seed)
    model = MODELS[kind]()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name else 0.08) * noise)
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def child_pids(pid: int) -> set[int]:
    """The live children of process ``pid``."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "zombie" not in status.lower()
