"""``load_model``: a Hugging Face directory (config.json + safetensors) or a GGUF file -> CausalLM."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.models.config import config_from_hf
from engine.models.llama import CausalLM, build_model


def load_model(path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> CausalLM:
    """Loads a model from a Hugging Face directory or a ``.gguf`` file, in ``dtype`` on ``device``."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from engine.models.gguf_loader import load_gguf_model

        return load_gguf_model(p, dtype, device)
    if p.is_dir():
        return load_hf_model(p, dtype, device)
    raise FileNotFoundError(f"{path}: expected a Hugging Face model directory or a .gguf file")


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


def load_hf_model(directory: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> CausalLM:
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
    model = build_model(config, dtype, device)
    model.load_weights(_iter_safetensors(names))
    return model


def _iter_safetensors(names: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, file in names.items():
        by_file.setdefault(file, []).append(name)
    progress = tqdm(total=len(names), desc="Loading weights", unit="tensor", file=sys.stderr, leave=False)
    with progress:
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in file_names:
                    yield name, f.get_tensor(name)
                    progress.update()
