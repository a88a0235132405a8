"""Gemma 2 against transformers on tiny random checkpoints: Gemma 3's layout without q/k norms or a local rope
base, with attention scores soft-capped before the softmax (``attn_logit_softcapping``, a path of its own: SDPA
cannot cap) and sliding windows on the even layers. Logits within 1e-4 (float32) past the window, in a mixed step
with chunked prefill, and the engine's greedy tokens; on the PyTorch path and the CPU kernels'."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, PreTrainedModel

from engine import LLM, SamplingParams
from engine.models import CausalLM, load_model
from tests.engine.kernel_probe import prepare, uses_cpu_ops
from tests.engine.models.moe_factory import greedy_reference, randomize, write_tokenizer
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, hf_logits, paged, prompt, run
from tests.engine.models.test_gemma3 import TOL

WINDOW = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
        query_pre_attn_scalar=24, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        final_logit_softcapping=30.0, attn_logit_softcapping=5.0)).eval()
    randomize(hf, 1)
    path = tmp_path_factory.mktemp("gemma2")
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf, path


@pytest.fixture(scope="module", params=["torch", "cpu-kernels"])
def pair(request: pytest.FixtureRequest, checkpoint: tuple[PreTrainedModel, Path]) -> tuple[PreTrainedModel, CausalLM]:
    hf, path = checkpoint
    ours = load_model(str(path), torch.float32)
    if request.param == "cpu-kernels":
        prepare(ours, torch.float32)
        assert uses_cpu_ops(ours)
    return hf, ours


def test_prefill_and_decode_past_the_window_match_transformers(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    assert [layer.self_attn.window for layer in ours.layers] == [WINDOW, None, WINDOW, None]
    assert ours.config.attn_logit_softcapping == 5.0 and not ours.config.qk_norm
    assert_prefill_then_greedy_decode(hf, ours, prompt(13, 2), 12)


def test_mixed_step_with_a_chunk_matches_transformers(pair: tuple[PreTrainedModel, CausalLM]) -> None:
    hf, ours = pair
    a, b = prompt(9, 3), prompt(15, 4)
    kv = paged(ours)
    run(ours, kv, [("a", a[:8]), ("b", b[:7])])
    logits = run(ours, kv, [("a", a[8:]), ("b", b[7:])])
    torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1:], hf_logits(hf, b)[7:], atol=TOL, rtol=0)


def test_the_engine_gives_transformers_greedy_tokens(checkpoint: tuple[PreTrainedModel, Path]) -> None:
    hf, path = checkpoint
    prompts = [prompt(n, 20 + n) for n in (4, 10)]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=8, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == [greedy_reference(hf, p, 10) for p in prompts]
