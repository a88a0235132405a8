"""GGUF Gemma 2, Gemma 3 (text) and Phi-3 files (engine.models.gguf_families) against transformers, on tiny random
checkpoints written as llama.cpp's convert_hf_to_gguf.py writes them: Gemma's norms stored as 1 + weight, no
query_pre_attn_scalar, Gemma 3's local rope base as rope.freq_base_swa, Phi-3's q/k/v and gate/up fused. The same
weights and config as the checkpoint directory gives, logits within 1e-4 (float32) past the sliding window, and
transformers' own GGUF reader loads the same files (F16 and Q8_0 too) to the logits ours give; what the loader does
not build is refused by name."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
)

from engine import LLM, SamplingParams
from engine.models import CausalLM, load_model
from engine.models.config import ModelConfig, config_from_hf
from engine.models.decoder_layer import Attention
from engine.models.gguf_loader import ModelReader, config_from_gguf
from engine.models.layers.linear import Linear
from tests.engine.kernel_probe import blocks_only, prepare
from tests.engine.models.moe_factory import greedy_reference, randomize, write_tokenizer
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, prompt

TOL = 1e-4
WINDOW = 6
Q = gguf.GGMLQuantizationType


def _gemma2() -> PreTrainedModel:
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
        query_pre_attn_scalar=16, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        final_logit_softcapping=30.0, attn_logit_softcapping=5.0))


def _gemma3() -> PreTrainedModel:
    # five sliding layers of six (llama.cpp's fixed pattern) on their own rope base, the global one linear-scaled
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
        query_pre_attn_scalar=16, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        final_logit_softcapping=30.0, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}))


def _phi3() -> PreTrainedModel:
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW + 1, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False))


_BUILD: dict[str, Callable[[], PreTrainedModel]] = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3}
_ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}
_WINDOWS = {"gemma2": [WINDOW, None] * 2, "gemma3": [WINDOW] * 5 + [None], "phi3": [WINDOW + 1] * 2}


@dataclasses.dataclass
class GgufFile:
    """What a converter writes: metadata (under the arch's prefix unless the key names its own) and tensors in
    torch order by GGUF name, matrices in ``qtype`` (vectors stay F32, as llama.cpp keeps them)."""

    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray]
    qtype: Q = Q.F32

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(str(path), arch=self.arch)
        for key, value in self.metadata.items():
            name = key if key.startswith(("tokenizer.", "general.")) else f"{self.arch}.{key}"
            if isinstance(value, bool):
                writer.add_bool(name, value)
            elif isinstance(value, int):
                writer.add_uint32(name, value)
            elif isinstance(value, float):
                writer.add_float32(name, value)
            elif isinstance(value, str):
                writer.add_string(name, value)
            else:
                writer.add_array(name, value)
        for name, array in self.tensors.items():
            array = np.ascontiguousarray(array, dtype=np.float32)
            if array.ndim == 1 or self.qtype == Q.F32:
                writer.add_tensor(name, array)
            elif self.qtype == Q.F16:
                writer.add_tensor(name, array.astype(np.float16))
            else:
                writer.add_tensor(name, quantize(array, self.qtype), raw_dtype=self.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def convert(hf: PreTrainedModel, kind: str) -> GgufFile:
    """The file convert_hf_to_gguf.py's Gemma2Model / Gemma3Model / Phi3MiniModel write from ``hf``."""
    cfg = hf.config
    m: dict[str, Any] = {
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "tokenizer.ggml.bos_token_id": cfg.bos_token_id, "tokenizer.ggml.eos_token_id": cfg.eos_token_id,
    }
    if kind == "gemma2":
        m.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                  "attn_logit_softcapping": float(cfg.attn_logit_softcapping),
                  "final_logit_softcapping": float(cfg.final_logit_softcapping),
                  "attention.sliding_window": cfg.sliding_window})
    elif kind == "gemma3":
        full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        m.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                  "rope.freq_base": float(full["rope_theta"]), "rope.freq_base_swa": float(local["rope_theta"]),
                  "rope.scaling.type": "linear", "rope.scaling.factor": float(full["factor"]),
                  "final_logit_softcapping": float(cfg.final_logit_softcapping),
                  "attention.sliding_window": cfg.sliding_window})
    else:
        m.update({"rope.scaling.original_context_length": cfg.original_max_position_embeddings,
                  "rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
                  "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
                  "attention.sliding_window": cfg.sliding_window or 0})
    names = gguf.get_tensor_name_map(_ARCH[kind], cfg.num_hidden_layers)
    tensors = {}
    for name, value in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = value.float().numpy()
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1   # Gemma's RMSNorm scales by 1 + weight: the converter stores the sum
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        tensors[new] = w
    return GgufFile(gguf.MODEL_ARCH_NAMES[_ARCH[kind]], m, tensors)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    out = {}
    for kind, build in _BUILD.items():
        torch.manual_seed(0)
        hf = build().eval()
        randomize(hf, 1)
        path = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(path)
        write_tokenizer(path)
        out[kind] = hf, path
    return out


def _expected_config(path: Path, tied: bool) -> ModelConfig:
    return config_from_hf(json.loads((path / "config.json").read_text()), None, has_lm_head=not tied)


@pytest.mark.parametrize("kind", list(_BUILD))
def test_gguf_matches_transformers_and_the_checkpoint_directory(
        kind: str, checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    hf, ckpt = checkpoints[kind]
    ours = load_model(str(convert(hf, kind).write(ckpt / "model.gguf")), torch.float32)
    expected = _expected_config(ckpt, hf.config.tie_word_embeddings)
    assert ours.config.norm_weight_offset == 0.0   # the file's norms are 1 + weight already
    assert dataclasses.replace(ours.config, rms_norm_eps=expected.rms_norm_eps,   # written as float32
                               norm_weight_offset=expected.norm_weight_offset) == expected
    assert [m.window for m in ours.modules() if isinstance(m, Attention)] == _WINDOWS[kind]
    reference = dict(load_model(str(ckpt), torch.float32).named_parameters())
    for name, param in ours.named_parameters():   # fused back from Phi-3's split parts; norms not offset twice
        torch.testing.assert_close(param, reference[name], rtol=0, atol=0, msg=name)
    assert_prefill_then_greedy_decode(hf, ours, prompt(13, 2), 10, atol=TOL)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=["F32", "F16"])
@pytest.mark.parametrize("kind", list(_BUILD))
def test_transformers_reads_the_written_file_to_the_same_logits(
        kind: str, qtype: Q, checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    """An independent check of ``convert``'s names and layout: transformers' GGUF reader (which reverses the norms'
    + 1 itself) loads the checkpoint's weights, and ours its logits. Its metadata mapping leaves out the soft-caps,
    the windows and the rope bases, so the checkpoint's config is passed."""
    hf, ckpt = checkpoints[kind]
    file = convert(hf, kind)
    file.qtype = qtype
    path = file.write(ckpt / f"{qtype.name}.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, gguf_file=path.name, config=hf.config,
                                                  dtype=torch.float32).eval()
    if qtype == Q.F32:   # (1 + w) - 1 is w to float32's rounding near 1
        for name, param in hf.state_dict().items():
            atol = 2e-7 if kind.startswith("gemma") and name.endswith("norm.weight") else 0.0
            torch.testing.assert_close(theirs.state_dict()[name], param, rtol=0, atol=atol, msg=name)
    ours = load_model(str(path), torch.float32)
    assert_prefill_then_greedy_decode(theirs, ours, prompt(11, 3), 6, atol=TOL)


def test_q8_0_phi3_keeps_the_blocks_of_its_fused_projections(
        checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    """attn_qkv and ffn_up read as their parts' rows: the parts' blocks stack back into the fused projections and
    the CPU kernels run on them, to transformers' logits for the same file."""
    hf, ckpt = checkpoints["phi3"]
    file = convert(hf, "phi3")
    file.qtype = Q.Q8_0
    path = file.write(ckpt / "q8_0.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, gguf_file=path.name, config=hf.config,
                                                  dtype=torch.float32).eval()
    ours = load_model(str(path), torch.float32)
    fused = [_linear(ours, "layers.1.self_attn.qkv_proj"), _linear(ours, "layers.1.mlp.gate_up_proj")]
    assert all(layer.holds_blocks for layer in fused)
    prepare(ours, torch.float32)
    assert all(blocks_only(layer) for layer in fused)
    assert_prefill_then_greedy_decode(theirs, ours, prompt(11, 4), 6, atol=TOL)


def _linear(model: CausalLM, name: str) -> Linear:
    layer = model.get_submodule(name)
    assert isinstance(layer, Linear)
    return layer


@pytest.mark.parametrize("kind", list(_BUILD))
def test_the_engine_gives_transformers_greedy_tokens(
        kind: str, checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    hf, ckpt = checkpoints[kind]
    path = convert(hf, kind).write(ckpt / "engine.gguf")
    prompts = [prompt(n, 10 + n) for n in (5, 11)]
    llm = LLM(str(path), tokenizer=str(ckpt), dtype="float32", block_size=4, num_kv_blocks=48,
              max_num_batched_tokens=8, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == [greedy_reference(hf, p, 10) for p in prompts]


def _metadata_only(kind: str, layers: int, keys: dict[str, Any] | None = None, hidden: int = 64, heads: int = 4,
                   head_dim: int = 16) -> GgufFile:
    """A file of ``kind``'s metadata (``keys`` on top) and an embedding table: enough for its config."""
    m: dict[str, Any] = {"context_length": 8192, "embedding_length": hidden, "block_count": layers,
                         "feed_forward_length": 4 * hidden, "attention.head_count": heads,
                         "attention.head_count_kv": heads, "attention.key_length": head_dim,
                         "attention.layer_norm_rms_epsilon": 1e-6, **(keys or {})}
    return GgufFile(kind, m, {"token_embd.weight": np.zeros((8, hidden), np.float32)})


def _config(file: GgufFile, path: Path) -> ModelConfig:
    return config_from_gguf(ModelReader(str(file.write(path))))


@pytest.mark.parametrize(("kind", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_the_27b_models_scale_queries_by_hidden_over_heads(kind: str, layers: int, tmp_path: Path) -> None:
    """llama.cpp's rule (the files carry no query_pre_attn_scalar): Gemma 2 27B's 4608 / 32 = 144 and Gemma 3
    27B's 5376 / 32 = 168 (their configs' query_pre_attn_scalar), head_dim in every other size."""
    hidden = 4608 if kind == "gemma2" else 5376
    big = _config(_metadata_only(kind, layers, None, hidden, 32, 128), tmp_path / "big.gguf")
    assert big.attn_scale == (hidden // 32) ** -0.5
    other = _config(_metadata_only(kind, layers - 2, None, hidden, 32, 128), tmp_path / "other.gguf")
    assert other.attn_scale == 128 ** -0.5


def test_gemma_defaults_are_llama_cpps(tmp_path: Path) -> None:
    """Without the keys: Gemma 2 slides over 4096 tokens on the even layers and caps at 50 / 30; Gemma 3's five
    layers of six slide on rope base 10000, and without a window none slides and every layer takes the global
    base."""
    g2 = _config(_metadata_only("gemma2", 4), tmp_path / "g2.gguf")
    assert (g2.sliding_window, g2.sliding_layers) == (4096, frozenset({0, 2}))
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.rope_local_theta is None and g2.hidden_act == "gelu_pytorch_tanh" and g2.sandwich_norms
    g3 = _config(_metadata_only("gemma3", 12, {"attention.sliding_window": 512}), tmp_path / "g3.gguf")
    assert g3.sliding_window == 512 and g3.sliding_layers == frozenset(range(12)) - {5, 11}
    assert g3.rope_local_theta == 10000.0 and g3.rope_local_layers == g3.sliding_layers
    assert g3.final_logit_softcapping is None and g3.attn_logit_softcapping is None
    none = _config(_metadata_only("gemma3", 12), tmp_path / "none.gguf")
    assert none.sliding_window is None and none.rope_local_layers == frozenset()


@pytest.mark.parametrize(("pattern", "sliding"), [
    (3, {0, 1, 3, 4}), (0, None), (1, frozenset()), ([True, False, False, True, True, False], {0, 3, 4}),
])
def test_a_sliding_window_pattern_key_replaces_the_default(pattern: Any, sliding: set[int] | None,
                                                           tmp_path: Path) -> None:
    keys = {"attention.sliding_window": 64, "attention.sliding_window_pattern": pattern}
    cfg = _config(_metadata_only("gemma3", 6, keys), tmp_path / "p.gguf")
    if sliding == frozenset():
        assert cfg.sliding_window is None and cfg.rope_local_layers == frozenset()
    else:
        assert cfg.sliding_window == 64 and cfg.sliding_layers == (None if sliding is None else frozenset(sliding))


def test_gemma2s_local_rope_base_when_the_file_has_one(tmp_path: Path) -> None:
    cfg = _config(_metadata_only("gemma2", 4, {"rope.freq_base_swa": 5000.0}), tmp_path / "swa.gguf")
    assert cfg.rope_local_theta == 5000.0 and cfg.rope_local_layers == frozenset({0, 2})


@pytest.mark.parametrize(("window", "expected"), [(2047, 2047), (0, None), (8192, None)])
def test_phi3s_window_slides_in_every_layer_unless_zero_or_past_the_context(window: int, expected: int | None,
                                                                           tmp_path: Path) -> None:
    """Phi-3 mini 4k's 2047 over its whole stack; the converter writes 0 for Phi-4 (no window), and a window no
    shorter than the context (Phi-3 128k's) changes nothing."""
    cfg = _config(_metadata_only("phi3", 4, {"attention.sliding_window": window}), tmp_path / "w.gguf")
    assert (cfg.sliding_window, cfg.sliding_layers) == (expected, None)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_qwen_sliding_window_key_is_ignored_as_llama_cpp_ignores_it(arch: str, tmp_path: Path) -> None:
    """The converter writes none (the published configs do not use one); transformers' Qwen applies a config's
    window only with use_sliding_window, and to layers max_window_layers picks, neither of which a file carries."""
    cfg = _config(_metadata_only(arch, 4, {"attention.sliding_window": 4}), tmp_path / "q.gguf")
    assert cfg.sliding_window is None and cfg.architecture == arch


@pytest.mark.parametrize("arch", ["phi2", "gemma3n", "gemma"])
def test_an_unsupported_architecture_is_refused_naming_it(arch: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"unsupported GGUF architecture '{arch}'"):
        _config(_metadata_only(arch, 2), tmp_path / "arch.gguf")


def test_what_is_not_built_is_refused_by_name(checkpoints: dict[str, tuple[PreTrainedModel, Path]],
                                              tmp_path: Path) -> None:
    hf, _ = checkpoints["phi3"]
    longrope = convert(hf, "phi3")
    longrope.tensors["rope_factors_long.weight"] = np.ones(8, np.float32)
    longrope.tensors["rope_factors_short.weight"] = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="phi3: LongRoPE"):
        load_model(str(longrope.write(tmp_path / "longrope.gguf")), torch.float32)
    partial = convert(hf, "phi3")
    partial.metadata["rope.dimension_count"] = 12
    with pytest.raises(ValueError, match=r"partial rotary \(rope.dimension_count=12 of head_dim 16\)"):
        load_model(str(partial.write(tmp_path / "partial.gguf")), torch.float32)
    extra = convert(checkpoints["gemma2"][0], "gemma2")
    extra.tensors["blk.1.attn_qkv.weight"] = np.zeros((128, 64), np.float32)   # Phi-3's name, no place in Gemma
    with pytest.raises(ValueError, match=r"'blk\.1\.attn_qkv\.weight' is not supported"):
        load_model(str(extra.write(tmp_path / "extra.gguf")), torch.float32)
    odd = convert(hf, "phi3")
    odd.tensors["blk.0.attn_qkv.weight"] = odd.tensors["blk.0.attn_qkv.weight"][:-16]
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_qkv\.weight' has 112 rows, not 64 \+ 32 \+ 32"):
        load_model(str(odd.write(tmp_path / "odd.gguf")), torch.float32)
