"""Reading a PEFT adapter folder (engine/models/lora.py): the weights and scalings PEFT applies, and every refusal
with its exact message."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from common.errors import InvalidRequestError
from engine.models.config import ModelConfig
from engine.models.lora import load_adapter, pattern_key
from tests.lora_factory import make_tiny_model, save_adapter

# The tiny Llama of tests/lora_factory.py: hidden 64, 4 heads of 16 (q 64), 2 kv heads (kv 32), intermediate 128.
CONFIG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=False)
PREFIX = "base_model.model.model.layers"


def _config(**changes: Any) -> dict[str, Any]:
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}}
    return {**base, **changes}


def _pair(out_features: int, in_features: int, r: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(r, in_features, generator=gen), torch.randn(out_features, r, generator=gen)


def _write(folder: Path, config: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None
           ) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config if config is not None else _config()))
    if tensors is None:
        a, b = _pair(64, 64)
        tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": a, f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": b}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def _refusal(path: str, max_rank: int = 16) -> str:
    with pytest.raises(InvalidRequestError) as e:
        load_adapter(path, CONFIG, max_rank=max_rank, dtype=torch.float32)
    assert e.value.field == "lora_path"
    return e.value.message


def test_peft_folder_loads_with_its_scaling_folded_into_b(tmp_path: Path) -> None:
    peft_model = save_adapter(make_tiny_model("llama"), tmp_path, r=8, alpha=16, targets=("q_proj", "down_proj"))
    adapter = load_adapter(str(tmp_path), CONFIG, max_rank=16, dtype=torch.float32)
    assert sorted(adapter.modules) == [(0, "down_proj"), (0, "q_proj"), (1, "down_proj"), (1, "q_proj")]
    assert adapter.rank == 8 and adapter.path == str(tmp_path)
    q = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    assert torch.equal(adapter.modules[(1, "q_proj")].a, q.lora_A["default"].weight)
    assert torch.equal(adapter.modules[(1, "q_proj")].b, q.lora_B["default"].weight * 2.0)   # 16 / 8
    assert adapter.nbytes == 4 * 2 * (8 * 64 + 64 * 8 + 8 * 128 + 64 * 8)


def test_rslora_alpha_pattern_and_dtype(tmp_path: Path) -> None:
    a, b = _pair(64, 64, r=4)
    a2, b2 = _pair(128, 64, r=4, seed=1)
    tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": a, f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": b,
               # a state dict taken from a live PeftModel names the adapter: accepted as well
               f"{PREFIX}.1.mlp.up_proj.lora_A.default.weight": a2, f"{PREFIX}.1.mlp.up_proj.lora_B.default.weight": b2}
    rs = load_adapter(_write(tmp_path / "rs", _config(r=4, lora_alpha=6, use_rslora=True), tensors), CONFIG,
                      max_rank=4, dtype=torch.bfloat16)
    assert rs.modules[(0, "q_proj")].b.dtype == torch.bfloat16
    assert torch.equal(rs.modules[(0, "q_proj")].b, (b * (6 / math.sqrt(4))).bfloat16())
    assert torch.equal(rs.modules[(1, "up_proj")].a, a2.bfloat16())
    # The first matching key wins, matched against a dotted suffix of model.layers.{i}.{parent}.{module}.
    pattern = {"layers.1.mlp.up_proj": 2, "up_proj": 100, "q_proj": 12}
    pat = load_adapter(_write(tmp_path / "pat", _config(r=4, lora_alpha=6, alpha_pattern=pattern), tensors),
                       CONFIG, max_rank=16, dtype=torch.float32)
    assert torch.equal(pat.modules[(0, "q_proj")].b, b * 3.0)
    assert torch.equal(pat.modules[(1, "up_proj")].b, b2 * 0.5)


def test_pattern_key_matches_as_peft_does() -> None:
    key = "model.layers.1.self_attn.q_proj"
    assert pattern_key(["k_proj", "q_proj"], key) == "q_proj"
    assert pattern_key(["layers.1.self_attn.q_proj", "q_proj"], key) == "layers.1.self_attn.q_proj"
    assert pattern_key([r"layers\.\d\.self_attn\.q_proj"], key) == r"layers\.\d\.self_attn\.q_proj"
    assert pattern_key(["_proj", "layers.11.self_attn.q_proj"], key) is None   # whole dotted parts only


def test_missing_folder_and_files(tmp_path: Path) -> None:
    assert _refusal(str(tmp_path / "nope")) == f"adapter folder {str(tmp_path / 'nope')!r} does not exist"
    assert _refusal(str(tmp_path)) == (f"adapter_config.json is missing from {str(tmp_path)!r}: "
                                       f"not a PEFT adapter folder")
    (tmp_path / "adapter_config.json").write_text(json.dumps(_config()))
    assert _refusal(str(tmp_path)) == f"adapter_model.safetensors is missing from {str(tmp_path)!r}"
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04 not unpickled")
    assert _refusal(str(tmp_path)) == (
        "only adapter_model.bin was found, a pickle, which Sluice never loads (it can run code): convert it to "
        "adapter_model.safetensors (PeftModel.save_pretrained(..., safe_serialization=True))")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    assert _refusal(str(tmp_path)).startswith("adapter_model.safetensors cannot be read: ")


def test_invalid_json(tmp_path: Path) -> None:
    path = _write(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": 8,')
    assert _refusal(path) == ("adapter_config.json is not valid JSON: Expecting property name enclosed in double "
                              "quotes: line 1 column 9 (char 8)")
    (tmp_path / "adapter_config.json").write_text("[8]")
    assert _refusal(path) == "adapter_config.json must hold a JSON object"


@pytest.mark.parametrize(("changes", "message"), [
    ({"peft_type": "LOHA"}, "adapter_config.json: peft_type is 'LOHA'; only LORA adapters are served"),
    ({"r": 32}, "adapter_config.json: r is 32, above --max-lora-rank 16"),
    ({"r": "8"}, "adapter_config.json: r must be a positive integer, got '8'"),
    ({"lora_alpha": "16"}, "adapter_config.json: lora_alpha must be a number, got '16'"),
    ({"use_dora": True}, "adapter_config.json: use_dora is true: DoRA adapters are not supported"),
    ({"fan_in_fan_out": True}, "adapter_config.json: fan_in_fan_out is true: only adapters of nn.Linear layers "
                               "(out x in weights) are supported"),
    ({"lora_bias": True}, "adapter_config.json: lora_bias is true: LoRA biases are not supported"),
    ({"bias": "lora_only"}, "adapter_config.json: bias is 'lora_only': adapters that train the base layers' "
                            "biases are not supported (only \"none\")"),
    ({"modules_to_save": ["lm_head"]}, "adapter_config.json: modules_to_save is ['lm_head']: adapters that replace "
                                       "whole modules are not supported (only LoRA matrices on q_proj, k_proj, "
                                       "v_proj, o_proj, gate_proj, up_proj, down_proj)"),
    ({"layer_replication": [[0, 2]]}, "adapter_config.json: layer_replication is set: layer replication is not "
                                      "supported"),
    ({"alpha_pattern": {"q_proj": "x"}}, "adapter_config.json: alpha_pattern must map module names to numbers"),
])
def test_config_refusals(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    assert _refusal(_write(tmp_path, _config(**changes))) == message


def _tensors(module: str, shape: tuple[int, int], layer: int = 0, parent: str = "self_attn", r: int = 8
             ) -> dict[str, torch.Tensor]:
    a, b = _pair(*shape, r=r)
    name = f"{PREFIX}.{layer}.{parent}.{module}"
    return {f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b}


TARGETS = "target_modules must be among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"


@pytest.mark.parametrize(("tensors", "message"), [
    ({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
      "base_model.model.lm_head.lora_B.weight": torch.zeros(128, 8)},
     "adapter_model.safetensors: tensor 'base_model.model.lm_head.lora_A.weight' adapts 'lm_head', which this model "
     f"has no LoRA target for: {TARGETS}"),
    ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 128)},
     "adapter_model.safetensors: tensor 'base_model.model.model.embed_tokens.lora_embedding_A' adapts "
     f"'model.embed_tokens', which this model has no LoRA target for: {TARGETS}"),
    (_tensors("gate_proj", (128, 64), parent="self_attn"),
     "adapter_model.safetensors: tensor 'base_model.model.model.layers.0.self_attn.gate_proj.lora_A.weight' adapts "
     f"self_attn.gate_proj, which this model has no LoRA target for: {TARGETS}"),
    (_tensors("dense", (64, 64), parent="mlp"),
     "adapter_model.safetensors: tensor 'base_model.model.model.layers.0.mlp.dense.lora_A.weight' adapts "
     f"mlp.dense, which this model has no LoRA target for: {TARGETS}"),
    (_tensors("q_proj", (64, 64), layer=2),
     "adapter_model.safetensors: tensor 'base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight' adapts "
     "layer 2, but the model has 2 layers (target_modules / layers_to_transform)"),
    ({"base_model.model.lm_head.weight": torch.zeros(128, 64)},
     "adapter_model.safetensors: tensor 'base_model.model.lm_head.weight' is not a LoRA matrix (lora_A / lora_B)"),
    (_tensors("k_proj", (64, 64)),   # k_proj is 32 wide in this model
     "adapter_model.safetensors: tensors 'model.layers.0.self_attn.k_proj.lora_A.weight' (8, 64) and "
     "'model.layers.0.self_attn.k_proj.lora_B.weight' (64, 8) do not fit the model's layer (64 in, 32 out): "
     "an adapter for another base model"),
    (_tensors("down_proj", (64, 96), parent="mlp"),
     "adapter_model.safetensors: tensors 'model.layers.0.mlp.down_proj.lora_A.weight' (8, 96) and "
     "'model.layers.0.mlp.down_proj.lora_B.weight' (64, 8) do not fit the model's layer (128 in, 64 out): "
     "an adapter for another base model"),
    (_tensors("q_proj", (64, 64), r=32),   # r 8 in the config, rank_pattern gave this module 32
     "adapter_model.safetensors: tensor 'model.layers.0.self_attn.q_proj.lora_A.weight' has rank 32, above "
     "--max-lora-rank 16"),
    ({f"{PREFIX}.1.mlp.up_proj.lora_A.weight": torch.zeros(8, 64)},
     "adapter_model.safetensors: model.layers.1.mlp.up_proj has lora_A but no lora_B"),
    ({f"{PREFIX}.1.mlp.up_proj.lora_B.weight": torch.zeros(128, 8)},
     "adapter_model.safetensors: model.layers.1.mlp.up_proj has lora_B but no lora_A"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
      f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)},
     "adapter_model.safetensors: tensor 'model.layers.0.self_attn.q_proj.lora_B.weight' has rank 4 but "
     "'model.layers.0.self_attn.q_proj.lora_A.weight' has rank 8"),
    ({}, "adapter_model.safetensors holds no LoRA tensors"),
], ids=["lm_head", "embed_tokens", "gate-in-attn", "unknown-module", "layer-index", "not-lora", "other-model-out",
        "other-model-in", "tensor-rank", "no-B", "no-A", "ranks-differ", "empty"])
def test_tensor_refusals(tmp_path: Path, tensors: dict[str, torch.Tensor], message: str) -> None:
    assert _refusal(_write(tmp_path, _config(), tensors)) == message


def test_an_adapter_for_another_base_model_is_refused(tmp_path: Path) -> None:
    # A real PEFT adapter of the tiny Llama, loaded against a model with a wider MLP.
    save_adapter(make_tiny_model("llama"), tmp_path, r=8, targets=("gate_proj",))
    wider = ModelConfig(**{**CONFIG.__dict__, "intermediate_size": 256})
    with pytest.raises(InvalidRequestError) as e:
        load_adapter(str(tmp_path), wider, max_rank=16, dtype=torch.float32)
    assert e.value.message == (
        "adapter_model.safetensors: tensors 'model.layers.0.mlp.gate_proj.lora_A.weight' (8, 64) and "
        "'model.layers.0.mlp.gate_proj.lora_B.weight' (128, 8) do not fit the model's layer (64 in, 256 out): "
        "an adapter for another base model")
