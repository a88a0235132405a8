"""Multi-token prediction (``{"method": "deepseek_mtp" | "mtp"}``) with a tiny random DeepSeek-V3 checkpoint whose
MTP layer was written in the hub's layout: the layer computes transformers' ``MtpModel`` logits, the proposer's first
proposal after a prefill is transformers' MTP argmax, greedy and seeded outputs are identical with and without it,
the proposals are counted, and what cannot run is refused naming the key."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from engine import LLM, InvalidRequestError, SamplingParams
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.mtp import load_mtp
from engine.worker.spec_decode.mtp import MtpProposer
from tests.engine.models.moe_factory import greedy_reference, write_checkpoint, write_mtp
from tests.engine.paged_factory import PagedKV

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 9, 88, 23, 61]

Checkpoint = tuple[PreTrainedModel, Any, Path]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    hf, path = write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek-mtp"))
    return hf, write_mtp(hf, path), path


def _reference_logits(hf: PreTrainedModel, mtp: Any, ids: list[int], next_token: int) -> torch.Tensor:
    """transformers' MTP logits at positions 1 .. len(ids): token q's embedding with the main model's hidden state
    at q - 1."""
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([ids])).last_hidden_state
        positions = torch.arange(1, len(ids) + 1)[None]
        out = mtp.forward_layer(0, hidden, positions, None, input_ids=torch.tensor([ids[1:] + [next_token]]))
        return mtp._project_to_logits(out)[0]


def test_the_mtp_layer_computes_transformers_logits(checkpoint: Checkpoint) -> None:
    hf, mtp_ref, path = checkpoint
    ours = load_mtp(str(path), torch.float32, "cpu")
    assert ours.num_layers == 1 and ours.embed_tokens is not None and ours.head is not None
    next_token = int(hf(input_ids=torch.tensor([PROMPT])).logits[0, -1].argmax())
    expected = _reference_logits(hf, mtp_ref, PROMPT, next_token)
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0]
    mla = hf.config
    kv = PagedKV(1, 1, mla.kv_lora_rank + mla.qk_rope_head_dim, block_size=4)
    kv.kv_caches = [c[:1].contiguous() for c in kv.kv_caches]
    # our entries sit at positions 0 .. 6 (the hidden states'), transformers' at 1 .. 7: the same attention
    step = kv.step([("a", PROMPT[1:] + [next_token])])
    with torch.no_grad():
        assert ours.embed_tokens is not None and ours.head is not None
        out = ours.layers[0](ours.embed_tokens(step.input_ids), hidden, step.positions, kv.kv_caches[0], step.meta)
        logits = ours.head(out)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_the_first_proposal_is_transformers_mtp_argmax(checkpoint: Checkpoint,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    hf, mtp_ref, path = checkpoint
    proposals: list[list[np.ndarray]] = []
    propose = MtpProposer.propose

    def spy(self: MtpProposer, scheduled: Any) -> list[np.ndarray]:
        out = propose(self, scheduled)
        proposals.append(out)
        return out

    monkeypatch.setattr(MtpProposer, "propose", spy)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64, seed=0,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1})
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    tokens = out[0].outputs[0].token_ids
    expected = int(_reference_logits(hf, mtp_ref, PROMPT, tokens[0])[-1].argmax())
    drafted = [p[0] for p in proposals if len(p) and len(p[0])]
    assert drafted and int(drafted[0][0]) == expected


@pytest.mark.parametrize("method,k", [("deepseek_mtp", 1), ("mtp", 3)])
def test_outputs_are_those_without_speculation(checkpoint: Checkpoint, method: str, k: int) -> None:
    hf, _, path = checkpoint
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 13, 3, 9)]
    settings: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=16,
                                    seed=0)
    spec = LLM(str(path), speculative_config={"method": method, "num_speculative_tokens": k}, **settings)
    plain = LLM(str(path), **settings)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    assert got == [greedy_reference(hf, p, 12) for p in prompts]
    # seeded sampling, several sequences per request (forks inherit the MTP state): the same tokens
    seeded = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=10, ignore_eos=True)
    with_mtp = [[c.token_ids for c in o.outputs] for o in spec.generate({"prompt_token_ids": prompts[1]}, seeded)]
    without = [[c.token_ids for c in o.outputs] for o in plain.generate({"prompt_token_ids": prompts[1]}, seeded)]
    assert with_mtp == without
    stats = spec.engine.spec_stats
    assert stats is not None and stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    info = spec.engine.info()
    assert info["free_kv_blocks"] == info["total_kv_blocks"]


def test_mtp_without_mtp_layers_is_refused_naming_the_method(tmp_path: Path) -> None:
    _, path = write_checkpoint("deepseek_v3", tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(InvalidRequestError, match="speculative_config.method.*no multi-token prediction layers"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, speculative_config={"method": "mtp",
                                                                             "num_speculative_tokens": 1})


def test_mtp_keys_that_cannot_run_are_refused(checkpoint: Checkpoint) -> None:
    _, _, path = checkpoint
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    with pytest.raises(InvalidRequestError, match="pipeline_parallel_size 1"):
        EngineConfig(model=str(path), pipeline_parallel_size=2, distributed_executor_backend="mp",
                     speculative_config=spec)
    with pytest.raises(InvalidRequestError, match="speculative_config.model"):
        EngineConfig(model=str(path), speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=2,
                                                                           model="/elsewhere"))
    with pytest.raises(InvalidRequestError, match="prompt_lookup_max"):
        SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=2, prompt_lookup_max=3)
