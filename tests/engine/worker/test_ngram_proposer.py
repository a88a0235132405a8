"""Prompt-lookup proposals (``ngram_propose``): the longest suffix match within [min_n, max_n] wins, the most
recent occurrence among equals, at most k tokens and never past the sequence's end; against a plain-Python
reference on random small sequences, and ``NgramProposer`` per scheduled row."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.core.request import Request, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler_output import ScheduledRequest
from engine.worker.spec_decode import DraftLengths
from engine.worker.spec_decode.ngram import NgramProposer, ngram_propose


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Try n from max_n down to min_n; the first n whose suffix occurred earlier (the occurrence ends before the
    last token) proposes the k tokens after its most recent occurrence."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    out = ngram_propose(np.asarray(tokens, dtype=np.int32), min_n, max_n, k)
    assert out.dtype == np.int64
    return out.tolist()


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    # Suffix (1, 2, 3): it occurs whole at 0 (then 10, 11); (2, 3) alone more recently at 5 (then 20, 21).
    tokens = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]
    assert propose(tokens, 1, 4, 2) == [10, 11]
    assert propose(tokens, 1, 2, 2) == [20, 21]   # capped at 2: both match 2 tokens, the recent one wins


def test_most_recent_occurrence_among_equal_lengths() -> None:
    tokens = [7, 5, 1, 7, 5, 2, 7, 5, 3, 9, 7, 5]
    assert propose(tokens, 1, 3, 1) == [3]
    assert propose(tokens, 2, 2, 3) == [3, 9, 7]


def test_a_match_shorter_than_min_n_proposes_nothing() -> None:
    tokens = [4, 8, 6, 9, 8]   # only the 1-gram (8) occurred before
    assert propose(tokens, 1, 3, 2) == [6, 9]
    assert propose(tokens, 2, 3, 2) == []


def test_k_truncates_at_the_end_of_the_sequence() -> None:
    # The most recent earlier 3 is the token before last: only the last token follows it.
    assert propose([1, 3, 4, 3, 3], 1, 1, 4) == [3]
    assert propose([5, 6, 5], 1, 4, 3) == [6, 5]


@pytest.mark.parametrize(("tokens", "min_n", "max_n", "k"), [
    ([1, 2, 3, 4], 1, 4, 3),     # no token repeats
    ([9], 1, 1, 2),              # nothing before the last token
    ([2, 2], 2, 3, 2),           # shorter than min_n + 1
    ([1, 2, 1], 1, 2, 0),        # k = 0
])
def test_no_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> None:
    assert propose(tokens, min_n, max_n, k) == []


def test_self_overlapping_runs() -> None:
    assert propose([1, 1, 1, 1], 1, 3, 4) == [1]          # (1, 1, 1) at 0, followed by the last token only
    assert propose([1, 2, 1, 2, 1, 2], 1, 4, 4) == [1, 2]  # (1, 2, 1, 2) at 0, overlapping the suffix


def test_matches_the_reference_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.randint(1, 4)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 24))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 5)
        assert propose(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_proposer_proposes_for_rows_with_lookahead_from_their_own_ids() -> None:
    a = Request("a", [5, 6, 7, 5, 6], SamplingParams())
    a.append_output_token(9)
    a.append_output_token(5)   # ids 5 6 7 5 6 9 5: only (5) occurred before, most recently at 3
    b = Request("b", [1, 2, 1], SamplingParams())
    rows = [ScheduledRequest(a, 1, a.num_tokens - 1, True, num_spec_tokens=2),
            ScheduledRequest(b, 1, b.num_tokens - 1, True, num_spec_tokens=0),
            ScheduledRequest(b, 1, b.num_tokens - 1, True, num_spec_tokens=5)]
    out = NgramProposer(1, 3, 5).propose(rows)
    assert [o.tolist() for o in out] == [[6, 9], [], [2, 1]]
    assert all(o.dtype == np.int64 for o in out)


def test_draft_lengths_follow_acceptance() -> None:
    """Two more after a proposal accepted whole, one fewer after a rejection, within [1, num_speculative_tokens]."""
    seq = SequenceId("a")
    lengths = DraftLengths(4)
    assert lengths.limit(seq, 3) == 3 and lengths.limit(seq, 9) == 4
    for accepted, want in ((1, 3), (0, 2), (0, 1), (0, 1), (1, 3), (3, 4), (4, 4)):
        lengths.proposed(seq, lengths.limit(seq, 4))
        lengths.accepted(seq, accepted)
        assert lengths.limit(seq, 4) == want
    lengths.proposed(seq, 0)       # nothing proposed: nothing learnt
    lengths.accepted(seq, 0)
    assert lengths.limit(seq, 4) == 4
    lengths.forget([seq])
    assert lengths.limit(seq, 4) == 4


def test_an_often_rejected_sequence_proposes_less() -> None:
    r = Request("r", [1, 2, 3, 4] * 3 + [1, 2], SamplingParams())
    proposer = NgramProposer(1, 3, 4)
    row = ScheduledRequest(r, 1, r.num_tokens - 1, True, num_spec_tokens=4)
    assert len(proposer.propose([row])[0]) == 4
    proposer.accepted(r.seq_id, 0)
    assert len(proposer.propose([row])[0]) == 3
