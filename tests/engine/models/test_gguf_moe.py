"""Mixture-of-experts GGUF files (engine.models.gguf_moe) against transformers, on the tiny random checkpoints of
moe_factory written as llama.cpp's convert_hf_to_gguf.py writes them: experts stacked per layer, Llama-arch q/k
permuted, DeepSeek's kv_b_proj split into attn_k_b / attn_v_b (or whole, as older converters left it), the metadata
keys it sets. Logits within 1e-4 (float32) and the same config as the checkpoint's config.json; what the loader
cannot map is refused by name."""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed import ParallelContext
from engine.models import CausalLM, load_model
from engine.models.config import config_from_hf
from engine.models.gguf_loader import ModelReader, config_from_gguf
from engine.models.moe import SparseMoeBlock
from tests.engine.models.moe_factory import VOCAB, build, randomize, write_checkpoint
from tests.engine.paged_factory import PagedKV

TOL = 1e-4

_ARCH = {"mixtral": gguf.MODEL_ARCH.LLAMA, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
         "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "deepseek_v2_lite": gguf.MODEL_ARCH.DEEPSEEK2,
         "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


@dataclasses.dataclass
class GgufFile:
    """What a converter would write: metadata (under the arch's prefix unless the key has a dot-qualified prefix
    already) and tensors in torch order, by GGUF name."""

    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray]
    quantized: set[str] = dataclasses.field(default_factory=set)   # tensors written as Q8_0

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(str(path), arch=self.arch)
        adders: dict[type, Callable[[str, Any], None]] = {bool: writer.add_bool, int: writer.add_uint32,
                                                          float: writer.add_float32, str: writer.add_string}
        for key, value in self.metadata.items():
            adders[type(value)](key, value)
        for name, array in self.tensors.items():
            if name in self.quantized:
                writer.add_tensor(name, quantize(array, gguf.GGMLQuantizationType.Q8_0),
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(kind: str, ckpt: Path, split_kv_b: bool = True) -> GgufFile:
    """The GGUF file convert_hf_to_gguf.py would write from checkpoint directory ``ckpt`` (float32). ``split_kv_b``:
    DeepSeek's kv_b_proj as attn_k_b / attn_v_b with the latent key and value lengths (the converter since 2025),
    else whole with the heads' lengths (before)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    arch = gguf.MODEL_ARCH_NAMES[_ARCH[kind]]
    layers = cfg["num_hidden_layers"]
    deepseek = kind.startswith("deepseek")
    m: dict[str, Any] = {
        "block_count": layers, "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": 1 if deepseek else cfg["num_key_value_heads"],
        "rope.freq_base": float(cfg["rope_parameters"]["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "expert_used_count": cfg["num_experts_per_tok"],
        "expert_count": cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"],
    }
    if cfg.get("n_group") is not None:
        m.update(expert_group_count=cfg["n_group"], expert_group_used_count=cfg["topk_group"])
    if kind == "mixtral":
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        m.update(vocab_size=cfg["vocab_size"], **{"rope.dimension_count": head_dim})
    elif kind in ("qwen2_moe", "qwen3_moe"):
        if cfg.get("head_dim"):
            m.update({"attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"]})
        m["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
        if cfg.get("shared_expert_intermediate_size"):
            m["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    else:
        rope, lora = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
        qk_head, v_head = cfg["qk_nope_head_dim"] + rope, cfg["v_head_dim"]
        m.update(leading_dense_block_count=cfg["first_k_dense_replace"], vocab_size=cfg["vocab_size"],
                 expert_feed_forward_length=cfg["moe_intermediate_size"],
                 expert_shared_count=cfg["n_shared_experts"],
                 expert_weights_scale=float(cfg["routed_scaling_factor"]),
                 # the hub's configs say scoring_func: V3 sigmoid, V2 softmax (older V2 files carry none)
                 **({"expert_gating_func": 2 if kind == "deepseek_v3" else 1} if split_kv_b else {}),
                 **{"attention.kv_lora_rank": lora, "rope.dimension_count": rope})
        if cfg["norm_topk_prob"]:
            m["expert_weights_norm"] = True
        if cfg.get("q_lora_rank"):
            m["attention.q_lora_rank"] = cfg["q_lora_rank"]
        if split_kv_b:
            m.update({"attention.key_length": lora + rope, "attention.value_length": lora,
                      "attention.key_length_mla": qk_head, "attention.value_length_mla": v_head})
        else:
            m.update({"attention.key_length": qk_head, "attention.value_length": v_head})
    metadata = {f"{arch}.{k}": v for k, v in m.items()}
    metadata.update({"tokenizer.ggml.bos_token_id": cfg["bos_token_id"],
                     "tokenizer.ggml.eos_token_id": cfg["eos_token_id"]})

    names = gguf.get_tensor_name_map(_ARCH[kind], layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)   # the dense layers of a sparse-step model
    tensors: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, value in load_file(str(ckpt / "model.safetensors")).items():
        w = value.float().numpy()
        if (e := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault((int(e.group(1)), _PROJ[e.group(3)]), {})[int(e.group(2))] = w
            continue
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("e_score_correction_bias"):
            tensors[f"blk.{layer}.exp_probs_b.bias"] = w
            continue
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
            kv_b = w.reshape(heads, nope + cfg["v_head_dim"], -1)
            tensors[f"blk.{layer}.attn_k_b.weight"] = kv_b[:, :nope].swapaxes(1, 2)
            tensors[f"blk.{layer}.attn_v_b.weight"] = kv_b[:, nope:]
            continue
        if kind == "mixtral" and name.endswith("q_proj.weight"):
            w = _llama_permute(w, cfg["num_attention_heads"])
        elif kind == "mixtral" and name.endswith("k_proj.weight"):
            w = _llama_permute(w, cfg["num_key_value_heads"])
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)   # written without its row axis, as transformers' GGUF reader expects
        new = (names.get_name(name, try_suffixes=(".weight", ".bias"))
               or dense.get_name(name, try_suffixes=(".weight", ".bias")))
        assert new is not None, name
        tensors[new] = w
    for (layer, proj), by_expert in experts.items():
        tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[i] for i in range(len(by_expert))])
    return GgufFile(arch, metadata, tensors)


def _logits(model: CausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logits, all in one step, then one decode step each: [len + 1, vocab] per prompt."""
    kv = PagedKV(model.num_local_layers, model.num_local_kv_heads, model.kv_head_dim, block_size=4,
                 backend=TorchAttentionBackend())
    kv.kv_caches = [c[:model.kv_planes].contiguous() for c in kv.kv_caches]
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for chunks in ([(str(i), p) for i, p in enumerate(prompts)],
                       [(str(i), [int(p[-1]) % VOCAB]) for i, p in enumerate(prompts)]):
            step = kv.step(chunks)
            hidden = model(step.input_ids, step.positions, kv.kv_caches, step.meta)
            assert isinstance(hidden, torch.Tensor)
            out.append(model.compute_logits(hidden))
    prefill, decode = out
    starts = np.cumsum([0] + [len(p) for p in prompts])
    return [torch.cat([prefill[starts[i]:starts[i + 1]], decode[i:i + 1]]) for i in range(len(prompts))]


def _hf_logits(hf: PreTrainedModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([p + [p[-1] % VOCAB]])).logits[0].float() for p in prompts]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 5)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    return {kind: write_checkpoint(kind, tmp_path_factory.mktemp(kind)) for kind in _ARCH}


@pytest.mark.parametrize(("kind", "split_kv_b"), [
    ("mixtral", True), ("qwen2_moe", True), ("qwen3_moe", True),
    ("deepseek_v2_lite", False), ("deepseek_v2", True), ("deepseek_v3", True),
])
def test_gguf_matches_transformers_and_the_checkpoints_config(
        kind: str, split_kv_b: bool, checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    hf, ckpt = checkpoints[kind]
    path = convert(kind, ckpt, split_kv_b).write(ckpt / "model.gguf")
    ours = load_model(str(path), torch.float32)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("num_nextn_predict_layers", None)   # the converter drops DeepSeek-V3's multi-token prediction layers
    expected = config_from_hf(cfg, None, has_lm_head=True)
    got = dataclasses.replace(ours.config, rms_norm_eps=expected.rms_norm_eps)   # written as float32
    assert got == expected
    for mine, theirs in zip(_logits(ours, _prompts()), _hf_logits(hf, _prompts()), strict=True):
        torch.testing.assert_close(mine, theirs, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_transformers_reads_the_written_file_as_the_checkpoint(kind: str, tmp_path: Path) -> None:
    """An independent check of ``convert``'s tensor names and layout: transformers' own GGUF reader (which knows
    qwen2moe / qwen3moe, not Mixtral or DeepSeek) loads the same weights, and our model its logits. Like llama.cpp it
    has no dense layers in these architectures: every layer sparse here. Its metadata mapping leaves out the expert
    sizes, so the checkpoint's config is passed."""
    config = build(kind).config
    config.mlp_only_layers, config.decoder_sparse_step = [], 1
    hf = type(build(kind))(config).eval()
    randomize(hf, seed=3)
    hf.save_pretrained(tmp_path)
    path = convert(kind, tmp_path).write(tmp_path / "model.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=hf.config,
                                                  dtype=torch.float32).eval()
    for name, param in hf.state_dict().items():
        torch.testing.assert_close(theirs.state_dict()[name], param, rtol=0, atol=0, msg=name)
    ours = load_model(str(path), torch.float32)
    assert ours.config.moe is not None and ours.config.moe.moe_layers == frozenset(range(3))
    for mine, reference in zip(_logits(ours, _prompts()), _hf_logits(theirs, _prompts()), strict=True):
        torch.testing.assert_close(mine, reference, atol=TOL, rtol=0)


def test_q8_0_experts_load_as_their_dequantized_values(checkpoints: dict[str, tuple[PreTrainedModel, Path]],
                                                       tmp_path: Path) -> None:
    """Mixtral with every matrix but the routers in Q8_0 (stacked experts quantized as one 3-D tensor, as
    llama-quantize does) against transformers on the same weights rounded through Q8_0."""
    hf, ckpt = checkpoints["mixtral"]
    file = convert("mixtral", ckpt)
    file.quantized = {n for n, t in file.tensors.items()
                      if t.ndim >= 2 and t.shape[-1] % 32 == 0 and ".ffn_gate_inp." not in n}
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight", "blk.1.attn_q.weight"} <= file.quantized
    ours = load_model(str(file.write(tmp_path / "q8.gguf")), torch.float32)
    assert ours.quantized_linears > 0   # the attention projections also keep their blocks for the kernels
    rounded = type(hf)(hf.config).eval()
    state = {}
    for name, param in hf.state_dict().items():
        if param.dim() >= 2 and param.shape[-1] % 32 == 0 and not name.endswith("mlp.gate.weight"):
            q8 = quantize(param.numpy(), gguf.GGMLQuantizationType.Q8_0)
            param = torch.from_numpy(dequantize(q8, gguf.GGMLQuantizationType.Q8_0).reshape(param.shape))
        state[name] = param
    rounded.load_state_dict(state)
    for mine, theirs in zip(_logits(ours, _prompts()), _hf_logits(rounded, _prompts()), strict=True):
        torch.testing.assert_close(mine, theirs, atol=TOL, rtol=0)
    assert not torch.allclose(_hf_logits(rounded, _prompts())[0], _hf_logits(hf, _prompts())[0], atol=TOL, rtol=0)


def test_fused_gate_up_experts_split_as_gate_then_up(checkpoints: dict[str, tuple[PreTrainedModel, Path]],
                                                     tmp_path: Path) -> None:
    """``--fuse-gate-up-exps``: one ffn_gate_up_exps [experts, 2 * intermediate, hidden] per layer."""
    hf, ckpt = checkpoints["qwen3_moe"]
    file = convert("qwen3_moe", ckpt)
    gate, up = file.tensors.pop("blk.1.ffn_gate_exps.weight"), file.tensors.pop("blk.1.ffn_up_exps.weight")
    file.tensors["blk.1.ffn_gate_up_exps.weight"] = np.concatenate((gate, up), axis=1)
    ours = load_model(str(file.write(tmp_path / "fused.gguf")), torch.float32)
    block = ours.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    torch.testing.assert_close(block.experts.w13, hf.model.layers[1].mlp.experts.gate_up_proj, rtol=0, atol=0)


def test_early_mixtral_files_with_one_tensor_per_expert(checkpoints: dict[str, tuple[PreTrainedModel, Path]],
                                                       tmp_path: Path) -> None:
    """Mixtral files from before the experts were stacked: blk.N.ffn_{gate,up,down}.E.weight."""
    hf, ckpt = checkpoints["mixtral"]
    file = convert("mixtral", ckpt)
    for proj in ("gate", "up", "down"):
        stacked = file.tensors.pop(f"blk.2.ffn_{proj}_exps.weight")
        file.tensors.update({f"blk.2.ffn_{proj}.{e}.weight": w for e, w in enumerate(stacked)})
    ours = load_model(str(file.write(tmp_path / "early.gguf")), torch.float32)
    block = ours.layers[2].mlp
    assert isinstance(block, SparseMoeBlock)
    torch.testing.assert_close(block.experts.w13, hf.model.layers[2].mlp.experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(block.experts.w2, hf.model.layers[2].mlp.experts.down_proj, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "expert_parallel"), [
    ("qwen2_moe", False), ("deepseek_v3", False), ("mixtral", True),
])
def test_a_tensor_rank_loads_the_shard_it_loads_from_the_checkpoint(
        kind: str, expert_parallel: bool, checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    """Rank 1 of 2: its slice of each expert (or, expert-parallel, its whole experts), of the shared experts and of
    the heads (DeepSeek's joined kv_b_proj rows) as the safetensors loader gives it."""
    _, ckpt = checkpoints[kind]
    path = convert(kind, ckpt).write(ckpt / "tp.gguf")
    parallel = ParallelContext(tp_size=2, rank=1, expert_parallel=expert_parallel)
    ours = dict(load_model(str(path), torch.float32, "cpu", parallel).named_parameters())
    reference = dict(load_model(str(ckpt), torch.float32, "cpu", parallel).named_parameters())
    assert set(ours) <= set(reference)   # the checkpoint may also hold DeepSeek-V3's prediction layer
    for name, param in ours.items():
        torch.testing.assert_close(param, reference[name], rtol=0, atol=0, msg=name)


def _refused(file: GgufFile, path: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(str(file.write(path)), torch.float32)


def test_a_tensor_without_a_place_is_refused_by_name(checkpoints: dict[str, tuple[PreTrainedModel, Path]],
                                                     tmp_path: Path) -> None:
    file = convert("deepseek_v3", checkpoints["deepseek_v3"][1])
    file.tensors["blk.1.nextn.eh_proj.weight"] = np.zeros((64, 128), np.float32)   # an MTP layer's
    _refused(file, tmp_path / "extra.gguf", r"'blk\.1\.nextn\.eh_proj\.weight' is not supported")
    del file.tensors["blk.1.nextn.eh_proj.weight"]
    del file.tensors["blk.2.attn_v_b.weight"]
    _refused(file, tmp_path / "half.gguf", "layer 2 has attn_k_b without its other half")


@pytest.mark.parametrize(("kind", "change", "match"), [
    # a sigmoid router without DeepSeek-V3's correction bias: neither V2's softmax nor V3's noaux_tc
    ("deepseek_v2", {"expert_gating_func": 2}, "scoring_func='sigmoid'"),
    ("deepseek_v3", {"expert_gating_func": 3}, r"deepseek2\.expert_gating_func=3"),
    ("deepseek_v3", {"expert_group_count": 3}, "n_group 3"),
    ("deepseek_v2", {"expert_group_used_count": None}, r"deepseek2\.expert_group_used_count"),
    ("qwen3_moe", {"rope.scaling.type": "yarn"}, "rope scaling 'yarn'"),
])
def test_unsupported_metadata_is_refused_naming_it(kind: str, change: dict[str, Any], match: str,
                                                   checkpoints: dict[str, tuple[PreTrainedModel, Path]],
                                                   tmp_path: Path) -> None:
    file = convert(kind, checkpoints[kind][1])
    for key, value in change.items():
        full = f"{file.arch}.{key}"
        if value is None:
            del file.metadata[full]
        else:
            file.metadata[full] = value
    with pytest.raises(ValueError, match=match):
        config_from_gguf(ModelReader(str(file.write(tmp_path / "bad.gguf"))))
