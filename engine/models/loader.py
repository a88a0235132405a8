"""``load_model``: a Hugging Face directory (config.json + safetensors) or a GGUF file -> CausalLM (the whole model,
or one rank's shard of its pipeline stage, read alone from the files), with W8A8 int8 projections when asked
(``quantization``) or when the directory is a compressed-tensors W8A8 checkpoint or an msModelSlim one."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from common.errors import InvalidRequestError
from engine.distributed import ParallelContext
from engine.models import compressed_tensors, int4_checkpoint, modelslim
from engine.models.config import ModelConfig, config_from_hf
from engine.models.int4 import Int4Weight
from engine.models.llama import CausalLM, build_model
from engine.models.sharding import Shard
from engine.models.w8a8 import Int8Weight
from engine.models.w8a8_static import AnyInt8Weight
from engine.models.weight_names import split_fused

# EngineConfig.quantization's values: None (the checkpoint's own weights), W8A8 (quantize float weights at load),
# COMPRESSED_TENSORS (require a compressed-tensors W8A8 int8 checkpoint), MODELSLIM (require an msModelSlim one:
# vLLM-Ascend's name "ascend", or "modelslim").
W8A8 = "w8a8"
COMPRESSED_TENSORS = compressed_tensors.QUANT_METHOD
MODELSLIM = ("ascend", "modelslim")
QUANTIZATIONS = (W8A8, COMPRESSED_TENSORS, *MODELSLIM, *int4_checkpoint.FLAGS)   # gptq / awq: require such a checkpoint


def load_model(path: str, dtype: torch.dtype, device: torch.device | str = "cpu",
               parallel: ParallelContext = ParallelContext(), quantization: str | None = None) -> CausalLM:
    """Loads a model from a Hugging Face directory or a ``.gguf`` file, in ``dtype`` on ``device``: the shard of
    ``parallel``'s rank of its stage (the whole model by default). Raises ValueError naming the sizes when the model
    does not split that way, before reading any weight.

    ``quantization``: ``"w8a8"`` quantizes every projection and the lm_head (not the embedding) to W8A8 int8 once
    the float weights are in (a GGUF file's dequantized ones: its blocks are dropped); a compressed-tensors W8A8
    checkpoint or an msModelSlim one is read as it is, whatever this says; ``"compressed-tensors"`` requires the
    former, ``"ascend"`` / ``"modelslim"`` the latter (InvalidRequestError naming ``quantization`` otherwise).
    The projections then hold ``Linear.int8`` for ``use_kernels``."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise InvalidRequestError("quantization", f"{quantization!r} is not supported; expected one of "
                                                  f"{', '.join(QUANTIZATIONS)}")
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from engine.models.gguf_loader import load_gguf_model

        if quantization == COMPRESSED_TENSORS:
            raise InvalidRequestError("quantization", _not_compressed(path, "a GGUF file"))
        if quantization in MODELSLIM:
            raise InvalidRequestError("quantization", _not_modelslim(quantization, path, "a GGUF file"))
        int4_checkpoint.check_flag(quantization, None, path)
        model = load_gguf_model(p, dtype, device, parallel)
    elif p.is_dir() and _model_type(p) in ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl"):   # vision_language
        from engine.models.vision_language import load_vision_language

        model = load_vision_language(p, safetensors_files(p), dtype, device, parallel, quantization)
    elif p.is_dir():
        model = load_hf_model(p, dtype, device, parallel, quantization)
    else:
        raise FileNotFoundError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    if quantization == W8A8 and model.int8_linears == 0:
        model.quantize_w8a8()
    return model


def _not_compressed(path: str, what: str) -> str:
    return (f"{COMPRESSED_TENSORS!r} needs a compressed-tensors W8A8 int8 checkpoint (config.json's "
            f"quantization_config); {path} is {what} of float weights: use --quantization {W8A8} to quantize it at "
            "load")


def _not_modelslim(quantization: str, path: str, what: str) -> str:
    return (f"{quantization!r} needs an msModelSlim checkpoint (a directory with {modelslim.DESCRIPTION}); {path} is "
            f"{what} without one: drop --quantization to run its own weights, or use --quantization {W8A8} to "
            "quantize float weights at load")


def read_model_config(path: str) -> ModelConfig:
    """The model's sizes from its config.json or GGUF metadata, no weights read."""
    if path.endswith(".gguf"):
        from engine.models.gguf_loader import ModelReader, config_from_gguf

        return config_from_gguf(ModelReader(path))
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("model_type") in ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl"):   # its language model's
        from engine.models.vision_language import language_config

        return language_config(cfg)
    return config_from_hf(cfg, None, has_lm_head=True)


def _model_type(directory: Path) -> str | None:
    config = directory / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.is_file() else None


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
                  parallel: ParallelContext = ParallelContext(), quantization: str | None = None) -> CausalLM:
    cfg = json.loads((directory / "config.json").read_text())
    sliced = modelslim.has_description(directory)
    qc = cfg.get("quantization_config")
    # msModelSlim drops quantization_config from config.json (older exports left one without a quant_method)
    int4_format = None if sliced else int4_checkpoint.read_format(cfg)   # GPTQ, AWQ, compressed-tensors W4A16
    int4_checkpoint.check_flag(quantization, int4_format, str(directory))
    scheme = None if int4_format is not None or (sliced and not (isinstance(qc, dict) and qc.get("quant_method"))) \
        else compressed_tensors.read_scheme(cfg)
    if scheme is not None and sliced:
        raise ValueError(f"{directory}: both a compressed-tensors quantization_config and {modelslim.DESCRIPTION}; "
                         "expected one quantization")
    if scheme is None and int4_format is None and quantization == COMPRESSED_TENSORS:
        raise InvalidRequestError("quantization", _not_compressed(str(directory), "a directory") if not sliced else
                                  f"{COMPRESSED_TENSORS!r} needs a compressed-tensors checkpoint; {directory} is an "
                                  "msModelSlim one: use --quantization ascend (or none)")
    if not sliced and quantization in MODELSLIM:
        raise InvalidRequestError("quantization", _not_modelslim(quantization, str(directory), "a directory"))
    gen_path = directory / "generation_config.json"
    gen_cfg = json.loads(gen_path.read_text()) if gen_path.exists() else None
    files = safetensors_files(directory)
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                names[name] = file
    config = config_from_hf(cfg, gen_cfg, has_lm_head="lm_head.weight" in names)
    slim = modelslim.read_scheme(directory, names, config)   # before building: refusals come first
    model = build_model(config, dtype, device, parallel)
    if slim is not None:
        int8: list[tuple[str, AnyInt8Weight]] = []
        slim_shard = modelslim.shard_of(model.weight_shard, slim)
        slim_tensors = split_fused(iter_safetensors(names, slim_shard), config, slim_shard)
        model.load_weights(modelslim.split_int8(slim_tensors, slim, dtype, model.weight_shard, int8))
        model.load_int8(int8)
        modelslim.drop_folded_biases(model)
        return model
    if int4_format is not None:
        int4: list[tuple[str, Int4Weight]] = []
        packed = iter_safetensors(names, int4_checkpoint.shard_of(model.weight_shard, int4_format))
        tensors = int4_checkpoint.split_int4(packed, int4_format, dtype, model.weight_shard, int4)
        model.load_weights(split_fused(tensors, config, model.weight_shard))
        int4_checkpoint.attach(model, int4)
        return model
    if scheme is None:
        model.load_weights(split_fused(iter_safetensors(names, model.weight_shard), config, model.weight_shard))
        return model
    compressed_tensors.check_tensor_names(names)
    ct_int8: list[tuple[str, Int8Weight]] = []
    shard_of = compressed_tensors.shard_of(model.weight_shard)
    tensors = split_fused(iter_safetensors(names, shard_of), config, shard_of)
    model.load_weights(compressed_tensors.split_int8(tensors, scheme, dtype, ct_int8))
    model.load_int8(ct_int8)
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
