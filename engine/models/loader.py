"""``load_model``: a Hugging Face directory (config.json + safetensors) or a GGUF file -> CausalLM (the whole model,
or one rank's shard of its pipeline stage, read alone from the files)."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.distributed import ParallelContext
from engine.models.config import ModelConfig, config_from_hf
from engine.models.llama import CausalLM, build_model
from engine.models.sharding import Shard


def load_model(path: str, dtype: torch.dtype, device: torch.device | str = "cpu",
               parallel: ParallelContext = ParallelContext()) -> CausalLM:
    """Loads a model from a Hugging Face directory or a ``.gguf`` file, in ``dtype`` on ``device``: the shard of
    ``parallel``'s rank of its stage (the whole model by default). Raises ValueError naming the sizes when the model
    does not split that way, before reading any weight."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from engine.models.gguf_loader import load_gguf_model

        return load_gguf_model(p, dtype, device, parallel)
    if p.is_dir():
        return load_hf_model(p, dtype, device, parallel)
    raise FileNotFoundError(f"{path}: expected a Hugging Face model directory or a .gguf file")


def read_model_config(path: str) -> ModelConfig:
    """The model's sizes from its config.json or GGUF metadata, no weights read."""
    if path.endswith(".gguf"):
        from gguf import GGUFReader

        from engine.models.gguf_loader import config_from_gguf

        return config_from_gguf(GGUFReader(path))
    return config_from_hf(json.loads((Path(path) / "config.json").read_text()), None, has_lm_head=True)


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's files: those named by the shard index when there is one (a directory may also
    hold a differently named consolidated copy), else every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    return files


def load_hf_model(directory: Path, dtype: torch.dtype, device: torch.device | str = "cpu",
                  parallel: ParallelContext = ParallelContext()) -> CausalLM:
    cfg = json.loads((directory / "config.json").read_text())
    gen_path = directory / "generation_config.json"
    gen_cfg = json.loads(gen_path.read_text()) if gen_path.exists() else None
    files = safetensors_files(directory)
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                names[name] = file
    config = config_from_hf(cfg, gen_cfg, has_lm_head="lm_head.weight" in names)
    model = build_model(config, dtype, device, parallel)
    model.load_weights(iter_safetensors(names, model.weight_shard))
    return model


def iter_safetensors(names: dict[str, Path], shard_of: Callable[[str], Shard | None]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor's ``shard_of(name)`` part, read alone from its file (safetensors slices); tensors whose shard is
    None are not read."""
    by_file: dict[Path, list[tuple[str, Shard]]] = {}
    for name, file in names.items():
        if (shard := shard_of(name)) is not None:
            by_file.setdefault(file, []).append((name, shard))
    total = sum(len(v) for v in by_file.values())
    progress = tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr, leave=False)
    with progress:
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name, shard in wanted:
                    if shard.dim is None:
                        yield name, f.get_tensor(name)
                    else:
                        part = f.get_slice(name)
                        end = shard.start + shard.size
                        yield name, part[shard.start:end] if shard.dim == 0 else part[:, shard.start:end]
                    progress.update()
