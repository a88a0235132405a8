"""Beam search in the engine core against transformers' ``generate(num_beams=...)`` on tiny random checkpoints;
best_of's choice; every block back in the pool after the end, an abort, and under preemption."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.sampling_params import BeamSearch, EarlyStopping, SamplingParams

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1,
               eos_token_id=None, pad_token_id=0)
ARCHS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=False)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=True)),
}
PROMPTS = [[1, 17, 40, 5, 63], [1, 8, 8, 30], [1, 90, 12, 44, 71, 3, 29]]
MAX_TOKENS = 10
# (beam width, length penalty, early stopping)
CASES: list[tuple[int, float, EarlyStopping]] = [(2, 1.0, False), (4, 1.0, False), (4, 0.5, True),
                                                 (2, 2.0, "never"), (4, 2.0, False)]


def _randomize(model: PreTrainedModel, seed: int) -> None:
    """Spread the weights out (transformers' init gives near-uniform logits, where every beam ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name else 0.15) * noise)


def _hf_beams(model: PreTrainedModel, prompt: list[int], width: int, length_penalty: float,
              early_stopping: EarlyStopping, eos: int | None) -> tuple[list[list[int]], list[float]]:
    """transformers' k best beams: output ids (EOS included, padding cut) and their scores."""
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                         max_new_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping,
                         eos_token_id=eos, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq in out.sequences[:, len(prompt):].tolist():
        if eos is not None and eos in seq:
            seq = seq[:seq.index(eos) + 1]
        beams.append(seq)
    return beams, out.sequences_scores.tolist()


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[PreTrainedModel, Path, int]:
    """A float32 random checkpoint whose EOS is a token its beams do emit: (model, its directory, eos id)."""
    torch.manual_seed(0)
    model = ARCHS[request.param]().eval()
    _randomize(model, seed=1)
    # The token the width-4 beams (searched without an EOS) emit most often after their first two tokens.
    emitted: Counter[int] = Counter()
    for prompt in PROMPTS:
        beams, _ = _hf_beams(model, prompt, 4, 1.0, False, None)
        emitted.update(t for beam in beams for t in beam[2:])
    eos = emitted.most_common(1)[0][0]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, eos


def _run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
         ) -> dict[str, list[EngineCoreOutput]]:
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    outputs: dict[str, list[EngineCoreOutput]] = {rid: [] for rid in requests}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id].append(out)
    return outputs


def _beam_params(width: int, length_penalty: float, early_stopping: EarlyStopping) -> SamplingParams:
    return SamplingParams(n=width, max_tokens=MAX_TOKENS,
                          beam_search=BeamSearch(width, length_penalty=length_penalty, early_stopping=early_stopping))


def _check_against_transformers(model: PreTrainedModel, eos: int, outputs: dict[str, list[EngineCoreOutput]]
                                ) -> Counter[FinishReason]:
    reasons: Counter[FinishReason] = Counter()
    for c, (width, length_penalty, early_stopping) in enumerate(CASES):
        for p, prompt in enumerate(PROMPTS):
            ours = outputs[f"{c}-{p}"]
            # One output per index, best first, each whole; the last ends the request.
            assert [o.index for o in ours] == list(range(width))
            assert [o.request_finished for o in ours] == [False] * (width - 1) + [True]
            beams, scores = _hf_beams(model, prompt, width, length_penalty, early_stopping, eos)
            assert [o.new_token_ids for o in ours] == beams, (c, p)
            for o, score in zip(ours, scores):
                assert o.cumulative_logprob is not None
                length = len(o.new_token_ids)
                assert o.cumulative_logprob / length ** length_penalty == pytest.approx(score, rel=1e-4, abs=1e-5)
                assert o.cumulative_logprob == pytest.approx(score * length ** length_penalty, rel=1e-4, abs=1e-5)
                expected = FinishReason.EOS if o.new_token_ids[-1] == eos else FinishReason.LENGTH
                assert o.finish_reason is expected and (expected is FinishReason.EOS or length == MAX_TOKENS)
                reasons[expected] += 1
    return reasons


def test_beams_match_transformers(tiny: tuple[PreTrainedModel, Path, int]) -> None:
    model, path, eos = tiny
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=256, block_size=4))
    requests = {f"{c}-{p}": (prompt, _beam_params(*case)) for c, case in enumerate(CASES)
                for p, prompt in enumerate(PROMPTS)}
    outputs = _run(core, requests)   # all searches batched together
    reasons = _check_against_transformers(model, eos, outputs)
    assert reasons[FinishReason.EOS] > 0 and reasons[FinishReason.LENGTH] > 0   # both ends are exercised
    assert core.scheduler.block_manager.num_free_blocks == 256
    assert not core.scheduler.requests


def test_beams_match_transformers_under_preemption(tiny: tuple[PreTrainedModel, Path, int]) -> None:
    """A cache that holds one width-4 search, not all of them: searches preempt each other and recompute."""
    model, path, eos = tiny
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=20, block_size=4,
                                   enable_prefix_caching=False))
    requests = {f"{c}-{p}": (prompt, _beam_params(*case)) for c, case in enumerate(CASES)
                for p, prompt in enumerate(PROMPTS)}
    outputs = _run(core, requests)
    _check_against_transformers(model, eos, outputs)
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.block_manager.num_free_blocks == 20


def test_best_of_reports_the_n_highest_cumulative_logprobs(tiny: tuple[PreTrainedModel, Path, int]) -> None:
    _, path, _ = tiny
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4))
    prompt = PROMPTS[0]
    # The same seed samples the same 5 sequences: all of them (n = 5), then the best 2 of them.
    every = _run(core, {"all": (prompt, SamplingParams(n=5, seed=7, max_tokens=6, ignore_eos=True, logprobs=0))})
    best = _run(core, {"best": (prompt, SamplingParams(n=2, best_of=5, seed=7, max_tokens=6, ignore_eos=True))})
    candidates = {}
    for o in every["all"]:
        if o.finished:
            assert o.cumulative_logprob is not None
            candidates[o.index] = o.cumulative_logprob
    tokens: dict[int, list[int]] = {}
    for o in every["all"]:
        tokens.setdefault(o.index, []).extend(o.new_token_ids)
    ranked = sorted(candidates, key=lambda i: -candidates[i])
    assert len(set(candidates.values())) == 5   # distinct: the ranking is not a tie-break
    assert [(o.index, o.new_token_ids, o.new_logprobs, o.request_finished) for o in best["best"]] == [
        (0, tokens[ranked[0]], None, False), (1, tokens[ranked[1]], None, True)]
    assert [o.cumulative_logprob for o in best["best"]] == pytest.approx([candidates[i] for i in ranked[:2]])
    assert core.scheduler.block_manager.num_free_blocks == 64


def test_abort_mid_search_ends_each_index_once_and_frees_every_block(tiny: tuple[PreTrainedModel, Path, int]
                                                                     ) -> None:
    _, path, _ = tiny
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4))
    core.add_request("beam", PROMPTS[0], _beam_params(4, 1.0, False).clone(n=3))
    core.add_request("best", PROMPTS[1], SamplingParams(n=2, best_of=3, max_tokens=MAX_TOKENS, ignore_eos=True))
    outputs: list[EngineCoreOutput] = []
    for _ in range(4):
        outputs += core.step()
    assert outputs == []   # held: nothing is streamed
    assert len([r for r in core.scheduler.running if r.request_id == "beam"]) == 4
    core.abort_requests(["beam", "best"])
    assert core.scheduler.block_manager.num_free_blocks == 64
    outputs = core.step()
    assert [(o.request_id, o.index, o.new_token_ids, o.finish_reason, o.request_finished) for o in outputs] == [
        ("beam", 0, [], FinishReason.ABORT, False), ("beam", 1, [], FinishReason.ABORT, False),
        ("beam", 2, [], FinishReason.ABORT, True),
        ("best", 0, [], FinishReason.ABORT, False), ("best", 1, [], FinishReason.ABORT, True)]
    assert not core.has_unfinished_requests() and not core.scheduler.requests


@pytest.mark.parametrize("params, field", [
    (SamplingParams(n=2, best_of=5), "best_of"),
    (SamplingParams(beam_search=BeamSearch(5)), "beam_search.beam_width"),
])
def test_widths_past_max_num_seqs_are_refused(tiny: tuple[PreTrainedModel, Path, int], params: SamplingParams,
                                              field: str) -> None:
    _, path, _ = tiny
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, max_num_seqs=4))
    with pytest.raises(InvalidRequestError) as e:
        core.add_request("r", PROMPTS[0], params)
    assert e.value.field == field
