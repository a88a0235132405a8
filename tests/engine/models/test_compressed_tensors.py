"""compressed-tensors W8A8 int8 checkpoints, written here in the format's own layout (int8 ``weight``, float
``weight_scale`` [out, 1], config.json's ``quantization_config`` with an ``ignore``d lm_head): they load with their
int8 codes and scales exactly, match ``--quantization w8a8`` on the same float weights, shard over tensor ranks,
and every scheme Sluice does not run is refused naming what."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import InvalidRequestError
from engine.core.sampling_params import SamplingParams
from engine.distributed import ParallelContext
from engine.entrypoints.llm import LLM
from engine.models import load_model
from engine.models.layers.linear import Linear
from engine.models.w8a8 import Int8Weight, quantize_weight
from tests.engine.executor.checkpoints import write_checkpoint

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# What llm-compressor writes for its W8A8 int8 scheme (dynamic per-token activations, per-channel weights).
W8A8_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                              "group_size": None, "block_structure": None, "observer": None},
        "output_activations": None}},
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
}


def write_w8a8(float_dir: Path, out: Path, scale_dtype: torch.dtype = torch.float32,
               config: dict[str, Any] | None = None, zero_points: bool = False) -> Path:
    """``float_dir``'s checkpoint with every projection (and an untied lm_head the config does not ignore) as int8
    codes and per-channel scales (quantize_weight)."""
    shutil.copytree(float_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    cfg_ignore = (W8A8_CONFIG if config is None else config).get("ignore") or []
    for name in list(tensors):
        quantized = name.split(".")[-2] in _PROJ or (name == "lm_head.weight" and "lm_head" not in cfg_ignore)
        if name.endswith(".weight") and quantized:
            weight = quantize_weight(tensors[name])
            tensors[name] = weight.qweight
            tensors[name + "_scale"] = weight.scale.to(scale_dtype).unsqueeze(1)
            if zero_points:
                tensors[name + "_zero_point"] = torch.zeros(weight.qweight.shape[0], 1, dtype=torch.int8)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = W8A8_CONFIG if config is None else config
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _int8(model: torch.nn.Module) -> dict[str, Int8Weight]:
    return {n: m.int8 for n, m in model.named_modules() if isinstance(m, Linear) and m.int8 is not None}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoints(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    float_dir = write_checkpoint(request.param, root / "float")
    return float_dir, write_w8a8(float_dir, root / "w8a8")


def test_checkpoint_loads_its_int8_weights_exactly_as_w8a8_quantizes_the_floats(
        checkpoints: tuple[Path, Path]) -> None:
    float_dir, w8a8_dir = checkpoints
    stored = load_file(str(w8a8_dir / "model.safetensors"))
    loaded = load_model(str(w8a8_dir), torch.float32)   # detected: no quantization given
    dynamic = _int8(load_model(str(float_dir), torch.float32, quantization="w8a8"))
    got = _int8(loaded)
    del dynamic["lm_head"]   # --quantization w8a8 quantizes the lm_head too; this checkpoint's ignores it
    assert len(got) == 16 and got.keys() == dynamic.keys()
    for name, weight in got.items():
        assert torch.equal(weight.qweight, dynamic[name].qweight) and torch.equal(weight.scale, dynamic[name].scale)
    # The fused q/k/v stacks the file's parts, codes and scales, untouched.
    qkv = got["layers.1.self_attn.qkv_proj"]
    parts = [f"model.layers.1.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.qweight, torch.cat([stored[p] for p in parts]))
    assert torch.equal(qkv.scale, torch.cat([stored[p + "_scale"][:, 0] for p in parts]))
    assert loaded.lm_head is not None and loaded.lm_head.int8 is None   # ignored: float
    assert load_model(str(w8a8_dir), torch.float32, quantization="compressed-tensors").int8_linears == 16
    assert load_model(str(w8a8_dir), torch.float32, quantization="w8a8").int8_linears == 16   # already W8A8


def test_scales_stored_in_bfloat16_are_read_as_stored(tmp_path: Path) -> None:
    float_dir = write_checkpoint("llama", tmp_path / "float")
    w8a8_dir = write_w8a8(float_dir, tmp_path / "w8a8", scale_dtype=torch.bfloat16, zero_points=True)
    stored = load_file(str(w8a8_dir / "model.safetensors"))
    got = _int8(load_model(str(w8a8_dir), torch.float32))
    down = got["layers.2.mlp.down_proj"]
    assert down.scale.dtype == torch.float32
    assert torch.equal(down.scale, stored["model.layers.2.mlp.down_proj.weight_scale"][:, 0].float())


def test_tensor_parallel_ranks_read_their_shard_of_weights_and_scales(tmp_path: Path) -> None:
    float_dir = write_checkpoint("llama", tmp_path / "float")
    w8a8_dir = write_w8a8(float_dir, tmp_path / "w8a8")
    stored = load_file(str(w8a8_dir / "model.safetensors"))
    for rank in range(2):
        got = _int8(load_model(str(w8a8_dir), torch.float32, "cpu", ParallelContext(tp_size=2, rank=rank)))
        up = "model.layers.0.mlp.up_proj.weight"   # column-parallel: rows of codes and scales
        gate_up = got["layers.0.mlp.gate_up_proj"]
        assert torch.equal(gate_up.qweight[64:], stored[up][rank * 64:(rank + 1) * 64])
        assert torch.equal(gate_up.scale[64:], stored[up + "_scale"][rank * 64:(rank + 1) * 64, 0])
        o = "model.layers.0.self_attn.o_proj.weight"   # row-parallel: columns of codes, every scale
        assert torch.equal(got["layers.0.self_attn.o_proj"].qweight, stored[o][:, rank * 32:(rank + 1) * 32])
        assert torch.equal(got["layers.0.self_attn.o_proj"].scale, stored[o + "_scale"][:, 0])


def test_greedy_tokens_through_llm_match_the_dynamic_path(tmp_path: Path) -> None:
    # Untied Llama with an int8 lm_head in the file: the layers --quantization w8a8 quantizes. (A tied lm_head is the
    # embedding table, which a compressed-tensors checkpoint keeps float while w8a8 gives it an int8 copy.)
    float_dir = write_checkpoint("llama", tmp_path / "float")
    w8a8_dir = write_w8a8(float_dir, tmp_path / "w8a8", config={**W8A8_CONFIG, "ignore": []})
    assert load_model(str(w8a8_dir), torch.float32).int8_linears == 17
    prompts = [[5, 9, 17, 33, 65], [7, 3, 101, 44]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for path, quantization in ((w8a8_dir, None), (float_dir, "w8a8")):
        llm = LLM(str(path), dtype="float32", quantization=quantization, kv_cache_memory="16MiB", max_num_seqs=4)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
        llm.close()
    assert outputs[0] == outputs[1] and all(len(t) == 12 for t in outputs[0])


def _variant(**changes: Any) -> dict[str, Any]:
    """W8A8_CONFIG with ``section__key=value`` changed: section ``top`` (quantization_config itself) or a key of
    the group (``weights``, ``input_activations``); ``section=value`` replaces the group's whole section."""
    cfg = copy.deepcopy(W8A8_CONFIG)
    group = cfg["config_groups"]["group_0"]
    for path, value in changes.items():
        section, _, key = path.partition("__")
        if not key:
            group[section] = value
        else:
            (cfg if section == "top" else group[section])[key] = value
    return cfg


@pytest.mark.parametrize("config, message", [
    (_variant(top__quant_method="fp8"), "quant_method 'fp8' is not supported"),
    (_variant(top__format="float-quantized"), "format 'float-quantized' is not supported"),
    (_variant(top__format="pack-quantized"), r"weights\.num_bits 8 is not supported: Sluice runs pack-quantized"),
    (_variant(input_activations__dynamic=False), r"input_activations\.dynamic False is not supported"),
    (_variant(input_activations__strategy="tensor"), r"input_activations\.strategy 'tensor' is not supported"),
    (_variant(weights__symmetric=False), r"weights\.symmetric False is not supported"),
    (_variant(weights__num_bits=4), r"weights\.num_bits 4 is not supported"),
    (_variant(weights__type="float"), r"weights\.type 'float' is not supported"),
    (_variant(weights__strategy="group", weights__group_size=128), r"weights\.strategy 'group' is not supported"),
    (_variant(input_activations=None), "weight-only int8 .W8A16. is not supported"),
    (_variant(top__kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme is not supported"),
])
def test_unsupported_schemes_are_refused_naming_the_key(tmp_path: Path, config: dict[str, Any],
                                                         message: str) -> None:
    float_dir = write_checkpoint("llama", tmp_path / "float")
    path = write_w8a8(float_dir, tmp_path / "w8a8", config=config)
    with pytest.raises(ValueError, match=message):
        load_model(str(path), torch.float32)


def test_static_activation_scales_and_asymmetric_zero_points_in_the_tensors_are_refused(tmp_path: Path) -> None:
    float_dir = write_checkpoint("llama", tmp_path / "float")
    path = write_w8a8(float_dir, tmp_path / "w8a8", zero_points=True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.input_scale"] = torch.ones(1)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.input_scale' belongs to a compressed-tensors scheme"):
        load_model(str(path), torch.float32)
    del tensors["model.layers.0.mlp.down_proj.input_scale"]
    tensors["model.layers.0.mlp.down_proj.weight_zero_point"][3] = 2
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="non-zero zero points"):
        load_model(str(path), torch.float32)


def test_compressed_tensors_on_a_float_checkpoint_is_refused(checkpoints: tuple[Path, Path]) -> None:
    float_dir, _ = checkpoints
    with pytest.raises(InvalidRequestError, match="quantization: 'compressed-tensors' needs a compressed-tensors") as e:
        load_model(str(float_dir), torch.float32, quantization="compressed-tensors")
    assert e.value.field == "quantization" and "--quantization w8a8" in e.value.message
