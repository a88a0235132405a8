"""A 32k-token context on a tiny YaRN model (factor 4 over an original 8192): the last position's logits equal
transformers', the prompt prefilled through the paged cache in chunks of 4096 as chunked prefill runs it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine.models import load_model
from tests.engine.models.moe_factory import randomize
from tests.engine.paged_factory import PagedKV

pytestmark = pytest.mark.slow

CONTEXT = 32768
CHUNK = 4096


def test_the_last_of_32k_positions_matches_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                         "rope_theta": 10000.0})).eval()
    randomize(hf, 1)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), torch.float32)
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling.rope_type == "yarn"
    ids = torch.randint(3, 128, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = PagedKV(ours.num_local_layers, ours.num_local_kv_heads, ours.kv_head_dim, num_blocks=CONTEXT // 16 + 8,
                 block_size=16)
    with torch.no_grad():
        for start in range(0, CONTEXT, CHUNK):
            step = kv.step([("a", ids[start:start + CHUNK])])
            hidden = ours(step.input_ids, step.positions, kv.kv_caches, step.meta)
            assert isinstance(hidden, torch.Tensor)
        last = ours.compute_logits(hidden[-1:])[0]
        expected = hf(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    torch.testing.assert_close(last, expected, atol=1e-4, rtol=0)
