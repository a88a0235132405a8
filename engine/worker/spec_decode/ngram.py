"""Prompt-lookup (n-gram) proposals: the tokens that followed the last n tokens where they occurred before.

A sequence that repeats its prompt — code edited in place, a summary quoting its source, a list re-emitted —
often continues as it did the last time its latest n tokens appeared. The longest n in
``[prompt_lookup_min, prompt_lookup_max]`` whose earlier occurrence exists wins; among occurrences of that
length, the most recent (vLLM's choice). Costs no model, only a scan of the sequence's ids.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.worker.spec_decode import DraftLengths

if TYPE_CHECKING:
    import torch

    from engine.core.request import SequenceId
    from engine.core.scheduler_output import ScheduledRequest

_EMPTY = np.empty(0, dtype=np.int64)


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens following the most recent earlier occurrence of the longest suffix of ``tokens`` of
    ``min_n`` to ``max_n`` tokens; empty when none occurs."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return _EMPTY
    last = tokens[-1]
    # Candidate ends of an earlier occurrence: every earlier position holding the last token.
    ends = np.flatnonzero(tokens[:-1] == last)
    if len(ends) == 0:
        return _EMPTY
    max_n = min(max_n, length - 1)
    # Match length at each candidate, up to max_n: compare the j-th token before each end with the j-th before
    # the sequence's end, stopping at the first difference (or the sequence's start).
    offsets = np.arange(max_n)
    idx = ends[:, None] - offsets[None, :]
    valid = idx >= 0
    same = valid & (tokens[np.maximum(idx, 0)] == tokens[length - 1 - offsets][None, :])
    lengths = np.cumprod(same, axis=1).sum(axis=1)
    best = int(lengths.max())
    if best < min_n:
        return _EMPTY
    end = int(ends[np.flatnonzero(lengths == best)[-1]])   # the most recent of the longest
    return tokens[end + 1:end + 1 + k].astype(np.int64)


class NgramProposer:
    """Proposes from each speculating row's own ids (prompt and output so far)."""

    wants_hidden = False

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.lengths = DraftLengths(num_speculative_tokens)

    def propose(self, scheduled: list[ScheduledRequest]) -> list[np.ndarray]:
        drafts = []
        for s in scheduled:
            if not s.num_spec_tokens:
                drafts.append(_EMPTY)
                continue
            seq_id = s.request.seq_id
            draft = ngram_propose(s.request.all_token_ids, self.min_n, self.max_n,
                                  self.lengths.limit(seq_id, s.num_spec_tokens))
            self.lengths.proposed(seq_id, len(draft))
            drafts.append(draft)
        return drafts

    def accepted(self, seq_id: SequenceId, num_accepted: int) -> None:
        self.lengths.accepted(seq_id, num_accepted)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        pass   # nothing per sequence that a fork needs

    def observe(self, scheduled: list[ScheduledRequest], row_tokens: list[int], kept: list[int],
                hidden: torch.Tensor) -> None:
        pass   # reads no hidden states (wants_hidden is False)

    def forget(self, seq_ids: list[SequenceId]) -> None:
        self.lengths.forget(seq_ids)
