"""GLM (``GlmForCausalLM``), GLM-4 (``Glm4ForCausalLM``), InternLM3, and the rope variants they and Phi bring —
partial rotary in halves (Phi-4-mini) and in interleaved pairs (GLM), dynamic NTK, longrope — against transformers
on tiny random checkpoints it writes. Logits within 1e-4 (float32) over a prefill and greedy decode steps, a mixed
step with chunked prefill and a prefix hit, on the PyTorch path and the CPU kernels', and the whole engine's greedy
tokens on a batch of mixed lengths."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Glm4Config,
    Glm4ForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    HeliumConfig,
    HeliumForCausalLM,
    InternLM3Config,
    LlamaConfig,
    LlamaForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    SeedOssConfig,
    SeedOssForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from engine import LLM, SamplingParams
from engine.distributed import ParallelContext
from engine.entrypoints.model_limits import model_context_length
from engine.models import CausalLM, load_model
from engine.models.config import config_from_hf
from tests.engine.kernel_probe import prepare, uses_cpu_ops
from tests.engine.models.moe_factory import greedy_reference, randomize, write_tokenizer
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, hf_logits, paged, prompt, run

TOL = 1e-4
_BASE: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             tie_word_embeddings=False)
# longrope's per-frequency divisors, one per rotated pair (Phi-4-mini's 0.75 of a 16-wide head: 6)
_SHORT = [1.0, 1.1, 1.3, 1.7, 2.2, 3.0]
_LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]


def _internlm3() -> PreTrainedModel:
    # transformers runs InternLM3 on its Llama implementation (the hub's config names its biases qkv_bias / bias,
    # both off in the released models)
    return AutoModelForCausalLM.from_config(InternLM3Config(**_BASE))


# name -> (constructor, the longest context the test asks the engine for)
MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "glm": lambda: GlmForCausalLM(GlmConfig(**{**_BASE, "partial_rotary_factor": 0.5})),
    "glm4": lambda: Glm4ForCausalLM(Glm4Config(**{**_BASE, "partial_rotary_factor": 0.5})),
    "internlm3": _internlm3,
    # Phi-4-mini: rope over 0.75 of each head, longrope (the short factors within the original 32 positions)
    # interleaved rope over the whole head, q/k/v bias without an o_proj one
    "helium": lambda: HeliumForCausalLM(HeliumConfig(**{**_BASE, "attention_bias": True})),
    # q/k/v and o biases set apart
    "seed_oss": lambda: SeedOssForCausalLM(SeedOssConfig(**{**_BASE, "attention_bias": True,
                                                           "attention_out_bias": True})),
    # a layer without rope, which also slides (its default layer types)
    "smollm3": lambda: SmolLM3ForCausalLM(SmolLM3Config(**{**_BASE, "use_sliding_window": True, "sliding_window": 6,
                                                          "no_rope_layers": [1, 0]})),
    # Granite's four multipliers
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**{
        **_BASE, "embedding_multiplier": 3.0, "residual_multiplier": 0.6, "attention_multiplier": 0.2,
        "logits_scaling": 2.5})),
    # a local and a global layer
    "ministral": lambda: MinistralForCausalLM(MinistralConfig(**{
        **_BASE, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]})),
    "phi3-partial-longrope": lambda: Phi3ForCausalLM(Phi3Config(**{
        **_BASE, "max_position_embeddings": 128, "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.75, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _SHORT, "long_factor": _LONG,
            "original_max_position_embeddings": 32, "partial_rotary_factor": 0.75}})),
}


def write(kind: str, path: Path) -> tuple[PreTrainedModel, Path]:
    torch.manual_seed(0)
    hf = MODELS[kind]().eval()
    randomize(hf, 1)
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf, path


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, PreTrainedModel, Path]:
    hf, path = write(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, path


def _ours(path: Path, kernels: bool, context: int | None = None) -> CausalLM:
    ours = load_model(str(path), torch.float32)
    if context is not None:
        ours.fit_context(context)
    if kernels:
        prepare(ours, torch.float32)
        assert uses_cpu_ops(ours)
    return ours


def test_the_config_is_read_as_transformers_reads_it(checkpoint: tuple[str, PreTrainedModel, Path]) -> None:
    kind, hf, path = checkpoint
    config = load_model(str(path), torch.float32).config
    # rotated dims, interleaved, sandwich norms, q/k/v bias, o_proj bias, the layers without rope, sliding layers
    expected = {"glm": (8, True, False, True, False, set(), []), "glm4": (8, True, True, True, False, set(), []),
                "internlm3": (16, False, False, False, False, set(), []),
                "helium": (16, True, False, True, False, set(), []),
                "seed_oss": (16, False, False, True, True, set(), []),
                "smollm3": (16, False, False, False, False, {1}, [None, 6]),
                "granite": (16, False, False, False, False, set(), []),
                "ministral": (16, False, False, False, False, set(), [6, None]),
                "phi3-partial-longrope": (12, False, False, False, False, set(), [])}[kind]
    windows = [config.window_of(i) for i in range(config.num_layers)] if config.sliding_window else []
    assert (config.rotary_dim, config.rope_interleaved, config.sandwich_norms, config.attention_bias,
            config.o_proj_bias, set(config.nope_layers), windows) == expected
    assert config.architecture == hf.config.model_type


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_prefill_and_decode_match_transformers(checkpoint: tuple[str, PreTrainedModel, Path], kernels: bool) -> None:
    kind, hf, path = checkpoint
    # Phi's longrope: the short factors for a context within the original 32 positions
    ours = _ours(path, kernels, 32 if kind.startswith("phi3") else None)
    assert_prefill_then_greedy_decode(hf, ours, prompt(13, 2), 12)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_mixed_step_chunks_and_a_prefix_hit_match_transformers(checkpoint: tuple[str, PreTrainedModel, Path],
                                                               kernels: bool) -> None:
    kind, hf, path = checkpoint
    ours = _ours(path, kernels, 32 if kind.startswith("phi3") else None)
    a, b = prompt(9, 3), prompt(15, 4)
    kv = paged(ours)
    run(ours, kv, [("a", a[:8]), ("b", b[:7])])
    logits = run(ours, kv, [("a", a[8:]), ("b", b[7:])])
    torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1:], hf_logits(hf, b)[7:], atol=TOL, rtol=0)
    c = b[:12] + prompt(5, 5)
    kv.tables["c"], kv.tokens["c"] = kv.tables["b"][:3], list(c[:12])
    torch.testing.assert_close(run(ours, kv, [("c", c[12:])]), hf_logits(hf, c)[12:], atol=TOL, rtol=0)


def test_the_engine_gives_transformers_greedy_tokens(checkpoint: tuple[str, PreTrainedModel, Path]) -> None:
    kind, hf, path = checkpoint
    prompts = [prompt(n, 10 + n) for n in (5, 11, 8)]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=12, seed=0,
              max_model_len=32 if kind.startswith("phi3") else None)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == [greedy_reference(hf, p, 10) for p in prompts]


# -- longrope past the original context ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def phi_longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    return write("phi3-partial-longrope", tmp_path_factory.mktemp("phi-long"))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_longrope_past_the_original_context_uses_the_long_factors_as_transformers(
        phi_longrope: tuple[PreTrainedModel, Path], kernels: bool) -> None:
    """A context longer than the original 32 positions (the declared 128, the default): transformers runs a
    sequence past 32 on the long factors at every position; so do we, prefilled in chunks and decoded."""
    hf, path = phi_longrope
    ours = _ours(path, kernels)
    tokens = prompt(40, 6)
    kv = paged(ours)
    run(ours, kv, [("a", tokens[:17])])
    logits = run(ours, kv, [("a", tokens[17:])])
    torch.testing.assert_close(logits, hf_logits(hf, tokens)[17:], atol=TOL, rtol=0)
    for _ in range(4):
        tokens.append(int(logits[-1].argmax()))
        logits = run(ours, kv, [("a", tokens[-1:])])
        torch.testing.assert_close(logits[0], hf_logits(hf, tokens)[-1], atol=TOL, rtol=0)
    # and the short factors would have given other logits: the choice is real
    short = _ours(path, kernels, 32)
    kv = paged(short)
    assert (run(short, kv, [("a", tokens)]) - hf_logits(hf, tokens)).abs().max() > 1e-3


def test_the_engine_takes_longrope_factors_from_max_model_len(phi_longrope: tuple[PreTrainedModel, Path]) -> None:
    hf, path = phi_longrope
    tokens = prompt(40, 7)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=16, seed=0)
    assert llm.engine.max_model_len == 128
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": tokens}], sp)[0].outputs[0].token_ids
    assert got == greedy_reference(hf, tokens, 6)


# -- dynamic NTK ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dynamic(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**_BASE, "max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})).eval()
    randomize(hf, 1)
    path = tmp_path_factory.mktemp("dynamic")
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf, path


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_dynamic_ntk_uses_the_base_for_the_whole_declared_context(dynamic: tuple[PreTrainedModel, Path],
                                                                  kernels: bool) -> None:
    """vLLM's reading: the context is max_position_embeddings x factor (64) and the base is raised for all of it,
    which is transformers' base for a 64-token sequence: its logits for one such sequence are ours at every
    position, prefilled in chunks and in a mixed step with another sequence, and from a prefix hit."""
    hf, path = dynamic
    ours = _ours(path, kernels)
    assert ours.config.max_position_embeddings == 64
    tokens, other = prompt(64, 8), prompt(9, 9)
    reference = hf_logits(hf, tokens)
    kv = paged(ours)
    got = [run(ours, kv, [("a", tokens[:20]), ("o", other)])[:20]]
    got.append(run(ours, kv, [("a", tokens[20:])]))
    torch.testing.assert_close(torch.cat(got), reference, atol=TOL, rtol=0)
    kv.tables["b"], kv.tokens["b"] = kv.tables["a"][:10], list(tokens[:40])
    torch.testing.assert_close(run(ours, kv, [("b", tokens[40:])]), reference[40:], atol=TOL, rtol=0)


def test_dynamic_ntk_context_is_the_engines_default_length(dynamic: tuple[PreTrainedModel, Path]) -> None:
    _, path = dynamic
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=48, seed=0)
    assert llm.engine.max_model_len == 64
    assert model_context_length(str(path)) == 64   # what the servers size their receive limits by


# -- refusals ------------------------------------------------------------------------------------------------------

def test_what_is_not_built_is_refused_by_name(phi_longrope: tuple[PreTrainedModel, Path]) -> None:
    _, path = phi_longrope
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="partial_rotary_factor=0.7 must leave an even number"):
        config_from_hf({**cfg, "partial_rotary_factor": 0.7, "rope_parameters": None}, None, True)
    with pytest.raises(ValueError, match="rope scaling type 'ntk-by-parts'"):
        config_from_hf({**cfg, "rope_parameters": {"rope_type": "ntk-by-parts", "factor": 2.0}}, None, True)
    with pytest.raises(ValueError, match="longrope rope scaling without original_max_position_embeddings"):
        config_from_hf({**cfg, "original_max_position_embeddings": None, "rope_parameters": {
            "rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}}, None, True)
    with pytest.raises(ValueError, match="mlp_bias=True"):
        config_from_hf({**cfg, "model_type": "internlm3", "bias": True}, None, True)


# -- tensor parallel over fused checkpoints ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["glm4", "phi3-partial-longrope"])
def test_fused_checkpoints_shard_over_tensor_ranks(kind: str, tmp_path: Path) -> None:
    """Phi's and GLM's checkpoints fuse q/k/v and gate/up: each rank takes its heads' rows of each part, as it
    would from the unfused tensors, and two ranks give transformers' greedy tokens."""
    hf, path = write(kind, tmp_path)
    layer = hf.model.layers[0]
    config = load_model(str(path), torch.float32).config
    attn = layer.self_attn
    q, k, v = (attn.qkv_proj.weight.split([config.q_size, config.kv_size, config.kv_size]) if kind.startswith("phi3")
               else (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    for rank in range(2):
        shard = load_model(str(path), torch.float32, "cpu", ParallelContext(tp_size=2, rank=rank)).layers[0]
        heads, kv, inter = config.q_size // 2, config.kv_size // 2, config.intermediate_size // 2
        assert torch.equal(shard.self_attn.qkv_proj.weight, torch.cat(
            [q[rank * heads:][:heads], k[rank * kv:][:kv], v[rank * kv:][:kv]]))
        assert torch.equal(shard.mlp.gate_up_proj.weight, torch.cat(
            [gate[rank * inter:][:inter], up[rank * inter:][:inter]]))
    prompts = [prompt(n, 20 + n) for n in (6, 11)]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp",
              num_kv_blocks=48, block_size=4, seed=0, max_model_len=32 if kind.startswith("phi3") else None)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    finally:
        llm.close()
    assert got == [greedy_reference(hf, p, 8) for p in prompts]
