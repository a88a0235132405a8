"""Phi-3 / Phi-4 (``phi3``) against transformers on tiny random checkpoints: q/k/v and gate/up come fused in the
checkpoint, loaded as they are; a sliding window in every layer. Logits within 1e-4 (float32) past the window and
the engine's greedy tokens; Phi's `yarn` (its longrope) is refused by name. Longrope,
partial rotary and tensor parallel are checked in test_dense_families."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM, PreTrainedModel

from engine import LLM, SamplingParams
from engine.models import load_model
from engine.models.config import config_from_hf
from tests.engine.kernel_probe import prepare
from tests.engine.models.moe_factory import greedy_reference, randomize, write_tokenizer
from tests.engine.models.paged_run import assert_prefill_then_greedy_decode, prompt

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    torch.manual_seed(0)
    hf = Phi3ForCausalLM(Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=7, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)).eval()
    randomize(hf, 1)
    path = tmp_path_factory.mktemp("phi3")
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf, path


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_prefill_and_decode_past_the_window_match_transformers(checkpoint: tuple[PreTrainedModel, Path],
                                                               kernels: bool) -> None:
    hf, path = checkpoint
    ours = load_model(str(path), torch.float32)
    # the checkpoint's fused tensors are our fused layout as they are
    assert torch.equal(ours.layers[0].self_attn.qkv_proj.weight, hf.model.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(ours.layers[1].mlp.gate_up_proj.weight, hf.model.layers[1].mlp.gate_up_proj.weight)
    if kernels:
        prepare(ours, torch.float32)
    assert [layer.self_attn.window for layer in ours.layers] == [7, 7]
    assert_prefill_then_greedy_decode(hf, ours, prompt(12, 2), 10)


def test_the_engine_gives_transformers_greedy_tokens(checkpoint: tuple[PreTrainedModel, Path]) -> None:
    hf, path = checkpoint
    prompts = [prompt(n, 30 + n) for n in (5, 11)]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=8, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == [greedy_reference(hf, p, 10) for p in prompts]


def test_what_is_not_built_is_refused_by_name(checkpoint: tuple[PreTrainedModel, Path]) -> None:
    _, path = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="yarn.*longrope"):
        config_from_hf({**cfg, "rope_scaling": {"type": "yarn", "factor": 4.0}, "rope_parameters": None},
                       None, True)
