"""Gemma 3 (text) against transformers on tiny random checkpoints: GeGLU, queries scaled by query_pre_attn_scalar,
embeddings by sqrt(hidden), (1 + weight) norms around attention and the MLP, q/k norms, local sliding-window layers
on their own rope base interleaved with global ones (linear-scaled rope), final logit soft-capping. Logits within
1e-4 (float32) over a prefill and decode steps past the window, a mixed step with chunked prefill, a prefix hit,
and the whole engine's greedy tokens; on the PyTorch path and the CPU kernels'."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedModel

from engine import LLM, SamplingParams
from engine.models import CausalLM, load_model
from engine.models.config import config_from_hf
from engine.models.layers.activation import GeluAndMul
from tests.engine.kernel_probe import prepare, uses_cpu_ops
from tests.engine.models.moe_factory import greedy_reference, randomize, write_tokenizer
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, backend_for, hf_logits, paged, prompt, run
from tests.engine.paged_factory import PagedKV

TOL = 1e-4
WINDOW = 6


def gemma3_config(**changes: object) -> Gemma3TextConfig:
    args: dict[str, object] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
        query_pre_attn_scalar=24, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        final_logit_softcapping=30.0, sliding_window_pattern=2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    args.update(changes)
    return Gemma3TextConfig(**args)


def write_gemma3(path: Path, **changes: object) -> tuple[PreTrainedModel, Path]:
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(gemma3_config(**changes)).eval()
    randomize(hf, 1)
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf, path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    return write_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module", params=["torch", "cpu-kernels"])
def pair(request: pytest.FixtureRequest, checkpoint: tuple[PreTrainedModel, Path]) -> tuple[PreTrainedModel, CausalLM]:
    hf, path = checkpoint
    ours = load_model(str(path), torch.float32)
    if request.param == "cpu-kernels":
        prepare(ours, torch.float32)
        assert uses_cpu_ops(ours)
    return hf, ours


def test_the_config_is_read_as_transformers_reads_it(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    _, ours = pair
    cfg = ours.config
    assert [layer.self_attn.window for layer in ours.layers] == [WINDOW, None, WINDOW, None]
    assert cfg.rope_local_layers == frozenset({0, 2}) and cfg.rope_local_theta == 10000.0
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is not None and cfg.rope_scaling.factor == 2.0
    assert ours.layers[0].self_attn.rotary is ours.rotary_local and ours.layers[1].self_attn.rotary is ours.rotary
    assert cfg.attn_scale == 24 ** -0.5 and cfg.final_logit_softcapping == 30.0 and cfg.tie_word_embeddings
    assert isinstance(ours.layers[0].mlp.act, GeluAndMul)


def test_prefill_and_decode_past_the_window_match_transformers(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    assert_prefill_then_greedy_decode(hf, ours, prompt(13, 2), 15)


def test_mixed_step_chunks_and_a_prefix_hit_match_transformers(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    a, b = prompt(9, 3), prompt(15, 4)
    kv = paged(ours)
    run(ours, kv, [("a", a[:8]), ("b", b[:7])])
    logits = run(ours, kv, [("a", a[8:]), ("b", b[7:])])
    torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1:], hf_logits(hf, b)[7:], atol=TOL, rtol=0)
    c = b[:12] + prompt(5, 5)
    kv.tables["c"], kv.tokens["c"] = kv.tables["b"][:3], list(c[:12])
    torch.testing.assert_close(run(ours, kv, [("c", c[12:])]), hf_logits(hf, c)[12:], atol=TOL, rtol=0)


def test_bfloat16_stays_as_close_to_float32_as_transformers_bfloat16(checkpoint: tuple[PreTrainedModel, Path]
                                                                     ) -> None:
    hf, path = checkpoint
    ours = prepare(load_model(str(path), torch.bfloat16), torch.bfloat16)
    hf16 = Gemma3ForCausalLM(gemma3_config()).eval()
    hf16.load_state_dict(hf.state_dict())
    hf16 = hf16.to(torch.bfloat16)
    tokens = prompt(12, 6)
    kv = PagedKV(ours.num_local_layers, ours.num_local_kv_heads, ours.kv_head_dim, block_size=4,
                 dtype=torch.bfloat16, backend=backend_for(ours))
    got = run(ours, kv, [("a", tokens)]).float()
    ref = hf_logits(hf, tokens)
    with torch.no_grad():
        ref16 = hf16(input_ids=torch.tensor([tokens])).logits[0].float()
    ours_err, theirs_err = float((got - ref).norm() / ref.norm()), float((ref16 - ref).norm() / ref.norm())
    assert ours_err < max(2 * theirs_err, 0.02), (ours_err, theirs_err)


def test_the_engine_gives_transformers_greedy_tokens(checkpoint: tuple[PreTrainedModel, Path]) -> None:
    hf, path = checkpoint
    prompts = [prompt(n, 10 + n) for n in (5, 11, 8)]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=12, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == [greedy_reference(hf, p, 10) for p in prompts]


@pytest.mark.parametrize(("key", "value"), [("use_bidirectional_attention", True),
                                            ("hidden_activation", "relu")])
def test_options_not_built_are_refused_naming_them(checkpoint: tuple[PreTrainedModel, Path], key: str,
                                                   value: object) -> None:
    import json

    _, path = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match=key.replace("hidden_activation", "hidden_act")):
        config_from_hf({**cfg, key: value}, None, has_lm_head=False)
