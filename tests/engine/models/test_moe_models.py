"""The mixture-of-experts and latent-attention models against transformers' own, on tiny random checkpoints in the
hub's per-expert layout: logits within 1e-4 (float32) over a prefill and 20 decode steps, batched with mixed
lengths and chunked prefill, on prefix-cache hits of the latent cache and after a recompute (preemption)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.models import CausalLM, load_model
from engine.models.layers.fused_moe import FusedMoE, GroupedMoEMethod
from engine.models.mla import MlaAttention
from engine.models.moe import SparseMoeBlock
from tests.engine.kernel_probe import kernels_chosen, prepare, uses_cpu_ops
from tests.engine.models.moe_factory import VARIANTS, VOCAB, write_checkpoint
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, backend_for, hf_logits, paged, prompt, run
from tests.engine.paged_factory import PagedKV

TOL = 1e-4
PATHS = ["torch", "cpu-kernels"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Each variant written once for the module."""
    return {kind: write_checkpoint(kind, tmp_path_factory.mktemp(kind)) for kind in VARIANTS}


@pytest.fixture(scope="module", params=[(v, p) for v in VARIANTS for p in PATHS], ids=lambda vp: "+".join(vp))
def pair(request: pytest.FixtureRequest, checkpoints: dict[str, tuple[PreTrainedModel, Path]]
         ) -> tuple[PreTrainedModel, CausalLM]:
    kind, path = request.param
    hf, ckpt = checkpoints[kind]
    ours = load_model(str(ckpt), torch.float32)
    if path == "cpu-kernels":
        prepare(ours, torch.float32)
        assert kernels_chosen(ours) and uses_cpu_ops(ours)
    return hf, ours


def test_layers_built_as_the_config_says(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    cfg = ours.config
    assert cfg.moe is not None
    sparse = [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    expected = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == expected and 0 < len(sparse) < cfg.num_layers or cfg.architecture == "mixtral"
    assert all(isinstance(layer.self_attn, MlaAttention) == (cfg.mla is not None) for layer in ours.layers)
    block = ours.layers[sparse[0]].mlp
    assert isinstance(block, SparseMoeBlock)
    assert block.experts.w13.shape == (8, 2 * cfg.moe.intermediate_size, cfg.hidden_size)
    assert isinstance(block.experts.method, GroupedMoEMethod)
    assert (block.experts.method.packed is not None) == uses_cpu_ops(ours)   # oneDNN-packed experts with kernels
    assert block.gate.weight.dtype == torch.float32


def test_prefill_then_greedy_decode_match_transformers(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    tokens = assert_prefill_then_greedy_decode(hf, ours, prompt(10, seed=2), 20)
    assert len(set(tokens[10:])) > 3   # the model says something: a check that cannot pass on constant logits


def test_mixed_step_of_decodes_and_prefill_chunks_matches_transformers(pair: tuple[PreTrainedModel, CausalLM]
                                                                        ) -> None:
    hf, ours = pair
    a, b, c, d = prompt(7, 3), prompt(5, 4), prompt(13, 5), prompt(3, 6)
    kv = paged(ours)
    run(ours, kv, [("a", a[:6]), ("b", b[:4]), ("c", c[:6])])  # c's prompt is chunked: 6 now, 7 next step
    logits = run(ours, kv, [("a", a[6:]), ("b", b[4:]), ("c", c[6:]), ("d", d)])
    assert logits.shape == (1 + 1 + 7 + 3, VOCAB)
    torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(hf, b)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[2:9], hf_logits(hf, c)[6:], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[9:], hf_logits(hf, d), atol=TOL, rtol=0)


def test_prefix_cache_hit_reads_another_sequences_cache(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    """Sequence b starts on a's first two full blocks (what the block manager hands out on a prefix hit) and
    computes only its own tokens after them, in one chunk and then decoding."""
    hf, ours = pair
    a = prompt(11, 7)
    kv = paged(ours)
    run(ours, kv, [("a", a)])
    b = a[:8] + prompt(5, 8)
    kv.tables["b"] = kv.tables["a"][:2]
    kv.tokens["b"] = list(b[:8])
    logits = run(ours, kv, [("b", b[8:])])
    torch.testing.assert_close(logits, hf_logits(hf, b)[8:], atol=TOL, rtol=0)
    b.append(int(logits[-1].argmax()))
    logits = run(ours, kv, [("a", [int(hf_logits(hf, a)[-1].argmax())]), ("b", b[-1:])])
    torch.testing.assert_close(logits[1], hf_logits(hf, b)[-1], atol=TOL, rtol=0)


def test_recompute_after_preemption_continues_the_same(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    """Preemption by recompute: the sequence's blocks are dropped and its prompt plus output prefilled again (in two
    chunks here), then it decodes on."""
    hf, ours = pair
    tokens = prompt(6, 9)
    kv = paged(ours)
    logits = run(ours, kv, [("a", tokens)])
    for _ in range(4):
        tokens.append(int(logits[-1].argmax()))
        logits = run(ours, kv, [("a", tokens[-1:])])
    tokens.append(int(logits[-1].argmax()))
    run(ours, kv, [("again", tokens[:7])])
    logits = run(ours, kv, [("again", tokens[7:])])
    torch.testing.assert_close(logits, hf_logits(hf, tokens)[7:], atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_bfloat16_stays_as_close_to_float32_as_transformers_bfloat16(
        kind: str, checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    hf, ckpt = checkpoints[kind]
    ours = load_model(str(ckpt), torch.bfloat16)
    prepare(ours, torch.bfloat16)
    hf16 = VARIANTS[kind]().eval()
    hf16.load_state_dict(hf.state_dict())
    hf16 = hf16.to(torch.bfloat16)
    kv = PagedKV(ours.num_local_layers, ours.num_local_kv_heads, ours.kv_head_dim, block_size=4,
                 dtype=torch.bfloat16, backend=backend_for(ours))
    kv.kv_caches = [c[:ours.kv_planes].contiguous() for c in kv.kv_caches]
    a, b = prompt(9, 7), prompt(6, 8)
    logits = run(ours, kv, [("a", a), ("b", b)])
    got = torch.stack([logits[8], logits[14]]).float()
    ref = torch.stack([hf_logits(hf, a)[-1], hf_logits(hf, b)[-1]])
    with torch.no_grad():
        ref16 = torch.stack([hf16(input_ids=torch.tensor([a])).logits[0, -1],
                             hf16(input_ids=torch.tensor([b])).logits[0, -1]]).float()
    ours_err = float((got - ref).norm() / ref.norm())
    theirs_err = float((ref16 - ref).norm() / ref.norm())
    assert ours_err < max(2 * theirs_err, 0.02), (ours_err, theirs_err)


def test_latent_cache_is_a_fraction_of_the_heads_cache(checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    _, ckpt = checkpoints["deepseek_v3"]
    ours = load_model(str(ckpt), torch.float32)
    mla = ours.config.mla
    assert mla is not None
    assert (ours.kv_planes, ours.num_local_kv_heads, ours.kv_head_dim) == (1, 1, 32 + 8)
    per_token = ours.kv_bytes_per_token(2)   # bfloat16: 3 layers x one latent of 32 + 8
    assert per_token == 3 * 40 * 2
    mha = 3 * ours.config.num_heads * (mla.qk_head_dim + mla.v_head_dim) * 2   # a key and a value of every head
    assert mha == 4 * per_token


def test_expert_weights_land_where_the_checkpoint_names_them(
        checkpoints: dict[str, tuple[PreTrainedModel, Path]]) -> None:
    hf, ckpt = checkpoints["mixtral"]
    ours = load_model(str(ckpt), torch.float32)
    experts = ours.layers[1].mlp.experts
    assert isinstance(experts, FusedMoE)
    theirs = hf.model.layers[1].mlp.experts   # fused in memory by transformers: [E, 2I, H] gate then up
    torch.testing.assert_close(experts.w13, theirs.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(experts.w2, theirs.down_proj, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "change", "named"), [
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("deepseek_v3", {"n_group": 3}, "n_group 3"),
])
def test_unsupported_options_are_refused_naming_them(kind: str, change: dict[str, object], named: str,
                                                     tmp_path: Path) -> None:
    _, ckpt = write_checkpoint(kind, tmp_path, **change)
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        load_model(str(ckpt), torch.float32)


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
         "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize(("kind", "rope"), [
    # DeepSeek-V2-Lite / V3's form: mscale and mscale_all_dim (attention factor 1, the softmax scale corrected)
    ("deepseek_v3", {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    ("deepseek_v2_lite", {**_YARN, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # Qwen's long-context form: cos and sin scaled by 0.1 ln(factor) + 1
    ("qwen3_moe", _YARN),
])
def test_yarn_rope_scaling_matches_transformers(kind: str, rope: dict[str, object], tmp_path: Path) -> None:
    from tests.engine.models.moe_factory import build

    hf = build(kind, rope_parameters=rope, max_position_embeddings=256)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), torch.float32)
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling.rope_type == "yarn"
    tokens = prompt(12, seed=5)
    kv = paged(ours)
    logits = run(ours, kv, [("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=TOL, rtol=0)
    for _ in range(5):
        tokens.append(int(logits[-1].argmax()))
        logits = run(ours, kv, [("a", tokens[-1:])])
        torch.testing.assert_close(logits[0], hf_logits(hf, tokens)[-1], atol=TOL, rtol=0)
