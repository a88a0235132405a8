from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.worker.sampler import Sampler, SamplingRow, make_generator
from engine.worker.sampling_ops import apply_min_p, apply_top_k_top_p, exponential_race

V = 8
EOS = 0
INF = float("inf")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tensors here are small: on a shared 2-core machine extra intra-op threads only spin (16x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_row(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), list(prompt or [1]), list(output or []), generator)


def make_sampler(vocab_size: int = V, seed: int = 0) -> Sampler:
    return Sampler(vocab_size=vocab_size, eos_token_ids={EOS}, seed=seed)


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits ``[1, len(probs)]`` whose softmax is ``probs``."""
    return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(masked[0])).flatten().tolist())


# --- greedy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax_and_never_picks_padding_columns(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, V + 3, generator=gen).to(dtype)
    logits[:, V:] = 50.0  # the model's padded output columns beyond the vocabulary
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(5)]
    out = make_sampler()(logits, rows)
    assert out.token_ids == logits[:, :V].argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_greedy_slow_path_takes_argmax_of_processed_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    before = logits.clone()
    # logprobs forces the slow path; the bias moves the argmax from 2 to 3.
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias={3: 1.5})
    out = make_sampler()(logits, [make_row(params)])
    assert out.token_ids == [3]
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2)) * 100
    rows = [make_row(SamplingParams(temperature=1e-7, top_p=0.5)) for _ in range(4)]
    assert make_sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_sampled_rows_keep_their_positions() -> None:
    logits = torch.full((3, V), -10.0)
    logits[0, 4] = 10.0
    logits[1, 6] = 10.0   # sampled row; top_k=1 makes it certain
    logits[2, 2] = 10.0
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=0)),
            make_row(SamplingParams(temperature=1.0, top_k=1)),
            make_row(SamplingParams(temperature=0.0))]
    assert make_sampler()(logits, rows).token_ids == [4, 6, 2]


# --- temperature, top-k, top-p, min-p ---------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_frequencies_match_softmax(temperature: float) -> None:
    raw = torch.tensor([1.0, 0.0, -1.0])
    n = 20000
    rows = [make_row(SamplingParams(temperature=temperature)) for _ in range(n)]
    out = make_sampler(vocab_size=3, seed=3)(raw.expand(n, 3), rows)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / n
    expected = (raw / temperature).softmax(dim=-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(4)) * 0.1  # near-flat: sampling would vary
    rows = [make_row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(6)]
    sampler = make_sampler()
    for _ in range(5):  # fresh noise each step
        assert sampler(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_samples_only_and_all_of_the_k_best() -> None:
    raw = torch.tensor([0.0, 2.0, 1.0, 1.5, -1.0, 0.5, 0.2, -0.5])
    n = 3000
    rows = [make_row(SamplingParams(temperature=1.0, top_k=3)) for _ in range(n)]
    assert set(make_sampler()(raw.expand(n, V), rows).token_ids) == {1, 3, 2}


def test_top_k_larger_than_vocab_keeps_everything() -> None:
    raw = torch.zeros(V)
    n = 2000
    rows = [make_row(SamplingParams(top_k=10 * V)) for _ in range(n)]
    assert set(make_sampler()(raw.expand(n, V), rows).token_ids) == set(range(V))


# token id -> probability, deliberately not in sorted order
_PROBS = [0.3, 0.05, 0.5, 0.15]


NO_K = torch.tensor([4])
NO_P = torch.tensor([1.0])


@pytest.mark.parametrize("num_candidates", [1024, 2, 1])  # 2 and 1 send some rows down the full-sort path
@pytest.mark.parametrize(("top_p", "nucleus"), [
    (0.1, {2}), (0.45, {2}), (0.6, {2, 0}), (0.79, {2, 0}), (0.9, {2, 0, 3}), (0.97, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_minimal_nucleus(top_p: float, nucleus: set[int], num_candidates: int) -> None:
    masked = apply_top_k_top_p(logits_of(_PROBS), NO_K, torch.tensor([top_p]), num_candidates=num_candidates)
    assert kept(masked) == nucleus
    # Surviving logits are untouched (renormalization happens in the final softmax).
    assert torch.equal(masked[0, sorted(nucleus)], logits_of(_PROBS)[0, sorted(nucleus)])


@pytest.mark.parametrize("num_candidates", [1024, 2, 1])
def test_top_p_applies_to_the_renormalized_top_k(num_candidates: int) -> None:
    # After top-k=2 the best token has 0.5 / 0.8 = 0.625 >= 0.6, so it alone is the nucleus;
    # against the full distribution (0.5 < 0.6) token 0 would be kept too.
    masked = apply_top_k_top_p(logits_of(_PROBS), torch.tensor([2]), torch.tensor([0.6]), num_candidates=num_candidates)
    assert kept(masked) == {2}
    assert kept(apply_top_k_top_p(logits_of(_PROBS), torch.tensor([2]), NO_P, num_candidates=num_candidates)) == {2, 0}


def test_top_k_top_p_per_row_settings() -> None:
    logits = logits_of(_PROBS).repeat(3, 1)
    masked = apply_top_k_top_p(logits, torch.tensor([4, 1, 3]), torch.tensor([0.6, 1.0, 1.0]))
    assert [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in masked] == [{2, 0}, {2}, {2, 0, 3}]


def test_top_k_keeps_tokens_tied_at_the_cutoff() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]])
    assert kept(apply_top_k_top_p(logits, torch.tensor([1]), torch.tensor([1.0]))) == {1, 2}
    assert kept(apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))) == {1, 2, 4}


def reference_kept(probs: list[float], top_k: int, top_p: float) -> set[int]:
    """Top-k then the minimal top-p nucleus, the slow obvious way."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k]
    total = sum(probs[i] for i in order)
    nucleus: list[int] = []
    mass = 0.0
    for i in order:
        if top_p < 1 and mass >= top_p:
            break
        nucleus.append(i)
        mass += probs[i] / total
    return set(nucleus)


def test_top_k_top_p_match_a_reference_on_both_paths() -> None:
    gen = torch.Generator().manual_seed(9)
    vocab, batch = 300, 40
    logits = torch.randn(batch, vocab, generator=gen) * torch.linspace(0.2, 6.0, batch).unsqueeze(1)
    top_k = torch.tensor([[vocab, 1, 5, 40, 250][i % 5] for i in range(batch)])
    top_p = torch.tensor([[1.0, 0.5, 0.9, 0.99][i % 4] for i in range(batch)])
    fast = apply_top_k_top_p(logits, top_k, top_p, num_candidates=32)
    assert torch.equal(fast, apply_top_k_top_p(logits, top_k, top_p, num_candidates=vocab))
    probs = logits.double().softmax(dim=-1)
    for i in range(batch):
        expected = reference_kept(probs[i].tolist(), int(top_k[i]), float(top_p[i]))
        assert set(torch.nonzero(torch.isfinite(fast[i])).flatten().tolist()) == expected, i


def test_top_p_sampling_stays_in_nucleus() -> None:
    n = 3000
    rows = [make_row(SamplingParams(top_p=0.79)) for _ in range(n)]
    assert set(make_sampler(vocab_size=4)(logits_of(_PROBS).expand(n, 4), rows).token_ids) == {2, 0}


@pytest.mark.parametrize(("min_p", "survivors"), [
    (0.0, {0, 1, 2, 3}), (0.09, {0, 1, 2, 3}), (0.2, {2, 0, 3}), (0.5, {2, 0}), (0.7, {2}), (1.0, {2}),
])
def test_min_p_drops_tokens_below_a_share_of_the_best(min_p: float, survivors: set[int]) -> None:
    assert kept(apply_min_p(logits_of(_PROBS), torch.tensor([min_p]))) == survivors


def test_min_p_sampling_stays_above_threshold() -> None:
    n = 3000
    rows = [make_row(SamplingParams(min_p=0.5)) for _ in range(n)]
    assert set(make_sampler(vocab_size=4)(logits_of(_PROBS).expand(n, 4), rows).token_ids) == {2, 0}


# --- penalties, logit bias, min_tokens -------------------------------------------------------

def test_penalties_follow_vllm_formulas() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0, -4.0, 1.0, 0.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    processed = make_sampler().process_logits(logits, [make_row(params, prompt=[1, 2], output=[2, 3, 3])])
    expected = torch.tensor([[
        0.5,                      # unseen
        2.0 / 2.0,                # prompt only, positive: divided
        -1.0 * 2.0 - 0.5 - 0.25,  # prompt + once in output, negative: multiplied, then freq x1 + presence
        3.0 / 2.0 - 1.0 - 0.25,   # twice in output: divided, freq x2, presence once
        -4.0, 1.0, 0.0, 0.0,
    ]])
    assert torch.equal(processed, expected)


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(repetition_penalty=0.5), [2.0, -0.5, 4.0, 2.0]),         # < 1 rewards repeats
    (SamplingParams(frequency_penalty=-1.0), [1.0, -1.0, 4.0, 2.0]),          # output counts only
    (SamplingParams(presence_penalty=1.0), [1.0, -1.0, 1.0, 0.0]),    # once, whatever the count
])
def test_each_penalty_alone(params: SamplingParams, expected: list[float]) -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 1.0]])
    processed = make_sampler(vocab_size=4).process_logits(logits, [make_row(params, prompt=[0, 1], output=[2, 2, 3])])
    assert processed[0].tolist() == expected


def test_penalties_leave_other_rows_of_the_batch_alone() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    rows = [make_row(SamplingParams(), prompt=[1, 2, 3], output=[4, 5]),
            make_row(SamplingParams(repetition_penalty=1.7, presence_penalty=1.0), prompt=[1, 2, 3], output=[4, 5]),
            make_row(SamplingParams(temperature=0.0), prompt=[1, 2], output=[6])]
    processed = make_sampler().process_logits(logits, rows)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])
    assert not torch.equal(processed[1], logits[1])
    assert torch.equal(processed[1, [0, 6, 7]], logits[1, [0, 6, 7]])  # untouched: never seen


def test_logit_bias_forces_a_token() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]]).repeat(2, 1)
    bias = {7: 100.0, 0: -100.0}
    rows = [make_row(SamplingParams(temperature=0.0, logit_bias=bias)),
            make_row(SamplingParams(temperature=1.0, logit_bias=bias))]
    sampler = make_sampler()
    assert sampler(logits, rows).token_ids == [7, 7]
    assert sampler.process_logits(logits, rows)[0].tolist() == [-95.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, 98.0]


def test_allowed_token_ids_mask_every_other_token_before_the_bias() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]]).repeat(3, 1)
    allowed = [3, 6]
    rows = [make_row(SamplingParams(temperature=0.0, allowed_token_ids=allowed, logit_bias={6: 10.0, 0: 50.0})),
            make_row(SamplingParams(temperature=1.0, allowed_token_ids=allowed), generator=make_generator(1)),
            make_row(SamplingParams(temperature=0.0))]
    sampler = make_sampler()
    # The bias lifts 6 over 3 but cannot bring back the masked 0 (vLLM masks first, then biases).
    assert sampler.process_logits(logits, rows)[0].tolist() == [-INF, -INF, -INF, 2.0, -INF, -INF, 9.0, -INF]
    assert kept(sampler.process_logits(logits, rows)[1:2]) == {3, 6}
    for _ in range(50):
        assert sampler(logits, rows).token_ids[::2] == [6, 0]
        assert sampler(logits, rows).token_ids[1] in allowed


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    logits = torch.tensor([[9.0, 1.0, 2.0, 3.0, 0.0, 8.0, 0.0, 0.0]])  # EOS (0) then stop id 5 are the best
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=ignore_eos)
    sampler = make_sampler()
    output: list[int] = []
    for _ in range(3):
        processed = sampler.process_logits(logits, [make_row(params, output=output)])
        assert processed[0, EOS] == -INF and processed[0, 5] == -INF
        output.append(sampler(logits, [make_row(params, output=output)]).token_ids[0])
    assert output == [3, 3, 3]
    assert sampler(logits, [make_row(params, output=output)]).token_ids == [EOS]
    assert torch.equal(sampler.process_logits(logits, [make_row(params, output=output)]), logits)


# --- logprobs ----------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_ordered_top_k() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    raw = logits.log_softmax(dim=-1)
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5), prompt=[1, 2]),
            make_row(SamplingParams(temperature=0.7, top_k=2, logprobs=0)),
            make_row(SamplingParams(temperature=0.0))]
    out = make_sampler()(logits, rows)
    assert out.logprobs[2] is None
    for i, k in ((0, 3), (1, 0)):
        entry = out.logprobs[i]
        assert entry is not None
        sampled, top, rank = entry
        assert math.isclose(sampled, raw[i, out.token_ids[i]].item(), abs_tol=1e-6)
        assert rank == int((raw[i] >= raw[i, out.token_ids[i]]).sum())  # 1 + the tokens more likely
        values, ids = raw[i].topk(k)
        assert list(top) == ids.tolist()  # most likely first
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-6)
        assert list(top.values()) == sorted(top.values(), reverse=True)


def test_logprobs_from_half_precision_logits() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    out = make_sampler()(logits, [make_row(SamplingParams(temperature=0.0, logprobs=2))])
    entry = out.logprobs[0]
    assert entry is not None
    raw = logits.float().log_softmax(dim=-1)[0]
    assert entry[0] == pytest.approx(raw.max().item(), abs=1e-6)
    assert list(entry[1]) == raw.topk(2).indices.tolist()


# --- seeds ---------------------------------------------------------------------------------------

SEEDED_V = 2048  # above the top-k/top-p candidate count, so both of its paths are exercised
_TABLE = torch.randn(SEEDED_V, SEEDED_V, generator=torch.Generator().manual_seed(8)) * 2


def fake_model(rows: list[SamplingRow]) -> torch.Tensor:
    """Logits that depend on each row's last token, so sampled tokens feed back into the next step."""
    last = [(row.output_token_ids or row.prompt_token_ids)[-1] for row in rows]
    return _TABLE[torch.tensor(last)]


def run_steps(rows: list[SamplingRow], steps: int, seed: int = 0) -> list[list[int]]:
    sampler = Sampler(vocab_size=SEEDED_V, eos_token_ids=set(), seed=seed)
    for _ in range(steps):
        out = sampler(fake_model(rows), rows)
        for row, token in zip(rows, out.token_ids):
            row.output_token_ids.append(token)
    return [row.output_token_ids for row in rows]


SEEDED_PARAMS = [
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=1234),
    SamplingParams(temperature=1.2, top_p=0.9, min_p=0.01, presence_penalty=0.5, seed=1234),
    SamplingParams(temperature=1.0, seed=1234),
]


def seeded_row(params: SamplingParams = SEEDED_PARAMS[0], seed: int = 1234) -> SamplingRow:
    return make_row(params, prompt=[3, 1, 4], generator=make_generator(seed))


def batch_mates(n: int) -> list[SamplingRow]:
    variety = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5, min_p=0.1),
               SamplingParams(temperature=3.0, top_p=0.99, frequency_penalty=0.5)]  # flat: needs the full sort
    return [make_row(variety[i % 4], prompt=[i * 37 % SEEDED_V, 7],
                     generator=make_generator(100 + i) if i % 3 == 0 else None) for i in range(n)]


@pytest.mark.parametrize("params", SEEDED_PARAMS)
def test_seeded_row_samples_the_same_tokens_alone_and_in_any_batch_position(params: SamplingParams) -> None:
    alone = run_steps([seeded_row(params)], steps=10)[0]
    assert len(set(alone)) > 3  # it really samples
    for position in (0, 7, 15):
        rows = batch_mates(15)
        rows.insert(position, seeded_row(params))
        assert run_steps(rows, steps=10, seed=99)[position] == alone


def test_different_seeds_give_different_tokens() -> None:
    assert run_steps([seeded_row(seed=1234)], steps=10)[0] == run_steps([seeded_row(seed=1234)], steps=10)[0]
    assert run_steps([seeded_row(seed=1234)], steps=10)[0] != run_steps([seeded_row(seed=4321)], steps=10)[0]


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    rows = lambda: [make_row(SamplingParams(), prompt=[i]) for i in range(4)]  # noqa: E731
    assert run_steps(rows(), steps=8, seed=5) == run_steps(rows(), steps=8, seed=5)
    assert run_steps(rows(), steps=8, seed=5) != run_steps(rows(), steps=8, seed=6)


@pytest.mark.parametrize("seed", [-1, 2**70, 0])
def test_make_generator_accepts_any_integer(seed: int) -> None:
    a = torch.empty(4).exponential_(generator=make_generator(seed))
    b = torch.empty(4).exponential_(generator=make_generator(seed))
    assert torch.equal(a, b)


def test_rejects_logits_that_do_not_match_rows() -> None:
    with pytest.raises(ValueError):
        make_sampler()(torch.zeros(2, V), [make_row()])


def test_exponential_race_never_picks_a_masked_token_on_a_zero_draw() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.75]])
    assert exponential_race(probs, torch.tensor([[0.0, 1.0, 1.0]])).tolist() == [2]
    assert exponential_race(probs, torch.tensor([[1.0, 0.1, 1.0]])).tolist() == [1]  # 0.25/0.1 beats 0.75/1
