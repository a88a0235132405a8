"""Speculative decoding keeps the target model's distribution (issue 27, acceptance point 2), and seeded requests
stay reproducible under it.

A tiny random Llama with a 16-token vocabulary samples at temperature 1 from a prompt that holds every token
followed by the model's own greedy continuation, so the n-gram proposer always proposes (and the target often
agrees). 20,032 sequences (313 requests, n=64) take their first token in the prefill step, then verify K=2
proposed tokens in one step. The tokens that step emits at each verified position are grouped by what precedes
them (the prefill's token, and the tokens accepted before them) and compared with transformers' softmax for
that prefix by a chi-squared goodness-of-fit test (cells expecting fewer than 5 samples pooled). The test
fails when p < 1e-3; it must also fail when rejection sampling is replaced by greedy acceptance.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import SchedulerOutput
from engine.worker.model_runner import Logprob, ModelRunner
from engine.worker.sampler import Sampler, SamplerOutput, SamplingRow
from engine.worker.structured_output import TokenMasks
from tests.engine.core.tiny_llama import save_tiny_llama

V = 16
K = 2
N = 64                   # sequences per request: the prompt is computed once, each fork samples on its own
NUM_REQUESTS = 313       # 20,032 sequences
P_MIN = 1e-3             # the chi-squared test rejects below this p-value
MIN_EXPECTED = 5.0       # Cochran's rule: cells expecting fewer samples are pooled
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=4)

Tiny = tuple[Path, LlamaForCausalLM, list[int]]
# A sampled token's position: "prefill", or j for the j-th token the verifying step emitted.
Samples = dict[str | int, dict[tuple[int, ...], list[int]]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = tmp_path_factory.mktemp("tiny-v16")
    model = save_tiny_llama(path, vocab_size=V)
    with torch.no_grad():   # peakier distributions: more proposals accepted, more samples at later positions
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(path)
    prompt: list[int] = []
    for token in range(V):
        prompt.append(token)
        for _ in range(K):
            prompt.append(int(_next_token_probs(model, prompt, [()])[0].argmax()))
    return path, model, prompt


def _next_token_probs(model: LlamaForCausalLM, prompt: list[int], contexts: list[tuple[int, ...]]) -> np.ndarray:
    """[len(contexts), V]: the target's next-token distribution after prompt + each context (all one length)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(c) for c in contexts])).logits[:, -1]
    return logits.double().softmax(-1).numpy()


def _core(path: Path, num_sequences: int, spec: SpeculativeConfig = SPEC) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_seqs=num_sequences,
                                   max_num_batched_tokens=(K + 1) * num_sequences,
                                   num_kv_blocks=2 * num_sequences + 64, speculative_config=spec))


def _sample(path: Path, prompt: list[int], num_requests: int, spec: SpeculativeConfig = SPEC) -> Samples:
    """Run the prefill step and the first verifying step of ``num_requests`` requests with n=N."""
    core = _core(path, num_requests * N, spec)
    for i in range(num_requests):
        core.add_request(f"r{i}", prompt, SamplingParams(n=N, temperature=1.0, ignore_eos=True, max_tokens=K + 3))
    first = {(o.request_id, o.index): o.new_token_ids for o in core.step()}
    verified = {(o.request_id, o.index): o.new_token_ids for o in core.step()}
    assert core.spec_stats is not None and core.spec_stats.num_drafts == num_requests * N   # all proposed
    samples: Samples = defaultdict(lambda: defaultdict(list))
    for key, [token] in first.items():
        samples["prefill"][()].append(token)
        emitted = verified[key]
        for j, t in enumerate(emitted):
            samples[j][(token, *emitted[:j])].append(t)
    return samples


def _pooled(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells merged in order of expectation, smallest first, until each expects at least MIN_EXPECTED."""
    order = np.argsort(expected)
    obs: list[float] = []
    exp: list[float] = []
    o = e = 0.0
    for i in order:
        o, e = o + observed[i], e + expected[i]
        if e >= MIN_EXPECTED:
            obs.append(o)
            exp.append(e)
            o = e = 0.0
    if e > 0 and exp:   # the remainder joins the last cell
        obs[-1] += o
        exp[-1] += e
    return np.array(obs), np.array(exp)


def chi_squared(model: LlamaForCausalLM, prompt: list[int], groups: dict[tuple[int, ...], list[int]]
                ) -> tuple[float, int, float]:
    """Pearson's statistic summed over the groups (each against the target's distribution after its prefix),
    its degrees of freedom, and the p-value: P(chi2(df) >= statistic), the regularised upper incomplete gamma
    Q(df / 2, statistic / 2)."""
    stat, df = 0.0, 0
    for length in sorted({len(c) for c in groups}):
        contexts = [c for c in groups if len(c) == length]
        for context, probs in zip(contexts, _next_token_probs(model, prompt, contexts)):
            tokens = groups[context]
            obs, exp = _pooled(np.bincount(tokens, minlength=V).astype(float), probs * len(tokens))
            stat += float(((obs - exp) ** 2 / exp).sum())
            df += len(obs) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                torch.tensor(stat / 2, dtype=torch.float64)).item()
    return stat, df, p


def test_verified_tokens_follow_the_target_distribution(tiny: Tiny) -> None:
    path, model, prompt = tiny
    samples = _sample(path, prompt, NUM_REQUESTS)
    counts = {pos: sum(map(len, groups.values())) for pos, groups in samples.items()}
    # Every sequence verified a proposal; enough were accepted that the later positions are tested too.
    assert counts["prefill"] == counts[0] == NUM_REQUESTS * N >= 20_000
    assert counts[1] >= 5_000 and counts[2] >= 1_000, counts
    for pos, groups in samples.items():
        stat, df, p = chi_squared(model, prompt, groups)
        assert p >= P_MIN, f"position {pos}: chi2 {stat:.1f} on {df} df, p = {p:.2e}"


def _always_accept(draft: np.ndarray, samples: list[int], lps: list[Logprob | None]
                   ) -> tuple[list[int], list[Logprob] | None]:
    return [*draft.tolist(), samples[len(draft)]], None


def _argmax_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept a proposed token when it is the target's most likely one (greedy verification), then the
    target's sample."""
    step: dict[str, list[int]] = {"argmax": [], "tokens": [], "at": [0]}
    call = Sampler.__call__

    def sampler_call(self: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                     masks: TokenMasks | None = None) -> SamplerOutput:
        out = call(self, logits, rows, masks)
        step["argmax"] = self.process_logits(logits, rows, masks).argmax(-1).tolist()
        step["tokens"], step["at"] = out.token_ids, [0]
        return out

    def accept(draft: np.ndarray, samples: list[int], lps: list[Logprob | None]
               ) -> tuple[list[int], list[Logprob] | None]:
        at = step["at"][0]
        step["at"][0] = at + len(draft) + 1
        assert step["tokens"][at:at + len(draft) + 1] == samples   # every row of the step verifies a proposal
        best = step["argmax"][at:at + len(draft) + 1]
        n = 0
        while n < len(draft) and draft[n] == best[n]:
            n += 1
        return [*draft[:n].tolist(), samples[n]], None

    monkeypatch.setattr(Sampler, "__call__", sampler_call)
    monkeypatch.setattr(ModelRunner, "_accept", staticmethod(accept))


@pytest.mark.parametrize("variant", ["always", "argmax"])
def test_the_chi_squared_test_rejects_greedy_acceptance(tiny: Tiny, monkeypatch: pytest.MonkeyPatch,
                                                       variant: str) -> None:
    """The test above has the power to see a verification that does not keep the distribution: here with a
    tenth of its samples."""
    path, model, prompt = tiny
    if variant == "always":
        monkeypatch.setattr(ModelRunner, "_accept", staticmethod(_always_accept))
    else:
        _argmax_acceptance(monkeypatch)
    samples = _sample(path, prompt, NUM_REQUESTS // 10)
    stat, df, p = chi_squared(model, prompt, samples[0])
    assert p < P_MIN, f"chi2 {stat:.1f} on {df} df, p = {p:.2e}"


def test_seeded_requests_repeat_under_speculation(tiny: Tiny) -> None:
    path, _, prompt = tiny

    def run() -> tuple[dict[str, list[int]], int]:
        core = _core(path, 8)
        for rid, seed in (("a", 7), ("b", 7), ("c", 8)):
            core.add_request(rid, prompt, SamplingParams(seed=seed, temperature=1.0, ignore_eos=True, max_tokens=24))
        tokens: dict[str, list[int]] = defaultdict(list)
        while core.has_unfinished_requests():
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
        assert core.spec_stats is not None
        return tokens, core.spec_stats.num_accepted_tokens

    first, accepted = run()
    assert accepted > 0
    assert run() == (first, accepted)
    assert first["a"] == first["b"] != first["c"]   # same seed and the same room to speculate: same tokens


def test_a_seeded_request_samples_the_same_tokens_whatever_lookahead_its_batch_leaves_it(tiny: Tiny) -> None:
    """The sampler's promise for seeded requests (the same tokens whatever the batch) holds under speculation,
    where the batch decides how many proposals a sequence verifies: alone, up to K a step; behind three
    speculating decodes in a budget of 10, few."""
    path, _, prompt = tiny

    def run(crowd: int) -> tuple[list[int], int]:
        core = EngineCore(EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=64,
                                       max_num_batched_tokens=10, speculative_config=SPEC))
        for i in range(crowd):
            core.add_request(f"x{i}", prompt[:6], SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=20))
        core.add_request("a", prompt[:6], SamplingParams(seed=7, temperature=1.0, ignore_eos=True, max_tokens=16))
        lookahead = 0
        schedule = core.scheduler.schedule

        def spy() -> SchedulerOutput:
            nonlocal lookahead
            out = schedule()
            lookahead += sum(s.num_spec_tokens for s in out.scheduled if s.request.request_id == "a")
            return out

        core.scheduler.schedule = spy  # type: ignore[method-assign]
        tokens: list[int] = []
        while core.has_unfinished_requests():
            tokens += [t for o in core.step() if o.request_id == "a" for t in o.new_token_ids]
        return tokens, lookahead

    alone, crowded = run(crowd=0), run(crowd=3)
    assert alone[1] > crowded[1]
    assert alone[0] == crowded[0]


# MTP proposals (issue 37): the same test with a tiny DeepSeek-V3 of the same vocabulary whose checkpoint carries a
# multi-token prediction layer. Random, it is accepted about as often as any fixed token (its target's flatter
# distribution helps): fewer sequences reach the later positions than with the n-gram proposer, and the positions
# are tested where they have samples.
MTP_SPEC = SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=K)
MTP_REQUESTS = 120


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list[int]]:
    from tests.engine.models.moe_factory import build, write_mtp

    path = tmp_path_factory.mktemp("tiny-deepseek-v16")
    model = build("deepseek_v3", vocab_size=V)
    model.save_pretrained(path)
    write_mtp(model, path)
    prompt: list[int] = []
    for token in range(V):
        prompt.append(token)
        prompt.append(int(_next_token_probs(model, prompt, [()])[0].argmax()))
    return path, model, prompt


def test_tokens_verified_against_mtp_proposals_follow_the_target_distribution(tiny_mtp: tuple[Path, Any, list[int]]
                                                                             ) -> None:
    path, model, prompt = tiny_mtp
    samples = _sample(path, prompt, MTP_REQUESTS, MTP_SPEC)
    counts = {pos: sum(map(len, groups.values())) for pos, groups in samples.items()}
    assert counts["prefill"] == counts[0] == MTP_REQUESTS * N
    assert counts.get(1, 0) >= 200, counts   # proposals were accepted: later positions are emitted and tested
    for pos, groups in samples.items():
        if counts[pos] < 200:
            continue
        stat, df, p = chi_squared(model, prompt, groups)
        assert p >= P_MIN, f"position {pos}: chi2 {stat:.1f} on {df} df, p = {p:.2e}"
