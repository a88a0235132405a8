"""GGUF Gemma 2, Gemma 3 (text), Phi-3 and GLM-4 files (engine.models.gguf_families) against transformers, on tiny
random checkpoints written as llama.cpp's convert_hf_to_gguf.py writes them (tests/engine/models/gguf_factory.py):
Gemma's norms stored as 1 + weight, no query_pre_attn_scalar, Gemma 3's local rope base as rope.freq_base_swa,
Phi-3's q/k/v and gate/up fused, GLM-4's gate/up fused, its sandwich norms and its interleaved rope over half of each
head. The same weights and config as the checkpoint directory gives, logits within 1e-4 (float32) past the sliding
window, and transformers' own GGUF reader (which has no GLM-4) loads the same files (F16 and Q8_0 too) to the
logits ours give; what the loader does not build is refused by name. (Phi-3's LongRoPE and the fused files under
tensor parallel: test_gguf_longrope_and_sharding.py.)"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Glm4Config,
    Glm4ForCausalLM,
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
from tests.engine.models.gguf_factory import GgufFile, Q, convert
from tests.engine.models.moe_factory import greedy_reference, randomize, write_tokenizer
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, prompt

TOL = 1e-4
WINDOW = 6


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


def _glm4() -> PreTrainedModel:
    # q/k/v biases, interleaved rope over half of each head (GLM-4-0414's), head_dim written as key_length
    return Glm4ForCausalLM(Glm4Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))


_BUILD: dict[str, Callable[[], PreTrainedModel]] = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3,
                                                    "glm4": _glm4}
_WINDOWS = {"gemma2": [WINDOW, None] * 2, "gemma3": [WINDOW] * 5 + [None], "phi3": [WINDOW + 1] * 2,
            "glm4": [None] * 2}
# the families transformers' GGUF reader knows
_TRANSFORMERS_READS = ["gemma2", "gemma3", "phi3"]


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
@pytest.mark.parametrize("kind", _TRANSFORMERS_READS)
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
    refusals: list[tuple[GgufFile, str]] = []
    half = convert(hf, "phi3")   # LongRoPE needs both its factor tensors
    half.tensors["rope_factors_long.weight"] = np.ones(8, np.float32)
    refusals.append((half, "phi3: LongRoPE without the tensor 'rope_factors_short.weight'"))
    short = convert(hf, "phi3")
    short.tensors.update({f"rope_factors_{k}.weight": np.ones(6, np.float32) for k in ("long", "short")})
    refusals.append((short, r"phi3: LongRoPE factors of 6 and 6 values, not 8 \(one per rotated pair"))
    no_original = convert(hf, "phi3")
    no_original.tensors.update({f"rope_factors_{k}.weight": np.ones(8, np.float32) for k in ("long", "short")})
    del no_original.metadata["rope.scaling.original_context_length"]
    refusals.append((no_original, "longrope rope scaling without original_max_position_embeddings"))
    odd = convert(hf, "phi3")
    odd.metadata["rope.dimension_count"] = 11
    refusals.append((odd, r"phi3: rope.dimension_count=11 of head_dim 16 is not supported"))
    gemma = convert(checkpoints["gemma2"][0], "gemma2")
    gemma.tensors["rope_factors_short.weight"] = np.ones(8, np.float32)
    refusals.append((gemma, r"'rope_factors_short.weight' \(LongRoPE\) is read for phi3 only, not 'gemma2'"))
    yarn = convert(checkpoints["glm4"][0], "glm4")   # what a newer converter writes for a YaRN GLM-4
    yarn.metadata.update({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0})
    refusals.append((yarn, "unsupported GGUF rope scaling 'yarn'"))
    extra = convert(checkpoints["gemma2"][0], "gemma2")
    extra.tensors["blk.1.attn_qkv.weight"] = np.zeros((128, 64), np.float32)   # Phi-3's name, no place in Gemma
    refusals.append((extra, r"'blk\.1\.attn_qkv\.weight' is not supported"))
    rows = convert(hf, "phi3")
    rows.tensors["blk.0.attn_qkv.weight"] = rows.tensors["blk.0.attn_qkv.weight"][:-16]
    refusals.append((rows, r"'blk\.0\.attn_qkv\.weight' has 112 rows, not 64 \+ 32 \+ 32"))
    for i, (file, message) in enumerate(refusals):
        with pytest.raises(ValueError, match=message):
            load_model(str(file.write(tmp_path / f"{i}.gguf")), torch.float32)


def test_glm4_rotates_the_whole_head_without_a_dimension_count(tmp_path: Path) -> None:
    """llama.cpp's default (the converter always writes the count: half of each head for GLM-4-0414)."""
    whole = _config(_metadata_only("glm4", 2), tmp_path / "whole.gguf")
    assert (whole.rotary_dim, whole.rope_interleaved, whole.sandwich_norms) == (16, True, True)
    half = _config(_metadata_only("glm4", 2, {"rope.dimension_count": 8}), tmp_path / "half.gguf")
    assert half.rotary_dim == 8 and half.partial_rotary_factor == 0.5
