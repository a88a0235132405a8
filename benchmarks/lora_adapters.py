"""Write random PEFT LoRA adapters for a model, for the LoRA serving benchmark (no model hub, no training).

    python -m benchmarks.lora_adapters --out /tmp/adapters --count 4 --rank 16     # the default model

The adapters are made by ``peft`` (``get_peft_model`` on a randomly initialised model of the same shapes, then
``save_pretrained``), so each folder is what a PEFT training run writes. Their weights are random: they measure
speed, not quality. Prints the ``--lora-modules`` arguments that serve them.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_config(model_path: str | None):  # type: ignore[no-untyped-def]
    """A transformers LlamaConfig / Qwen2Config with the shapes of the model Sluice would load."""
    from gguf import GGUFReader
    from transformers import LlamaConfig, Qwen2Config

    from engine.config import default_model_path
    from engine.models.gguf_loader import config_from_gguf

    path = model_path or default_model_path()
    if not path.endswith(".gguf"):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    mc = config_from_gguf(GGUFReader(path))
    cls = Qwen2Config if mc.architecture == "qwen2" else LlamaConfig
    return cls(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
               num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
               head_dim=mc.head_dim, tie_word_embeddings=mc.tie_word_embeddings)


def write_adapters(out: Path, count: int, rank: int, model_path: str | None = None, seed: int = 0) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = hf_config(model_path)
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(config)
    paths = []
    for i in range(count):
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False,
                          task_type="CAUSAL_LM")
        model = get_peft_model(base, lora)
        with torch.no_grad():   # small values: the outputs stay close to the base model's, as a fine-tune's do
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        path = out / f"lora{i}"
        model.save_pretrained(str(path))
        base = model.unload()   # the plain model again, for the next adapter
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: the default model)")
    args = p.parse_args()
    t0 = time.perf_counter()
    paths = write_adapters(args.out, args.count, args.rank, args.model)
    print(f"wrote {len(paths)} adapters in {time.perf_counter() - t0:.1f} s")
    print("--enable-lora --max-lora-rank", args.rank, "--lora-modules",
          " ".join(f"lora{i}={p}" for i, p in enumerate(paths)))


if __name__ == "__main__":
    main()
