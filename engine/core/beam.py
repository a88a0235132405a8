"""Beam search for one request, with Hugging Face transformers' rules (``GenerationMixin._beam_search``).

Each step every running beam proposes its best tokens; the candidates are the
top ``max(2, 1 + number of stop tokens) * width`` of (beam cumulative logprob +
token logprob) across the beams. Of those, a candidate that ends its sequence (a
stop token, or the length limit) becomes a finished hypothesis only when it
ranks among the first ``width``, scored ``cumulative_logprob / length **
length_penalty`` (length: output tokens, the stop token included); the best
``width`` candidates that do not end continue. The best ``width`` hypotheses are
kept. Sums and scores are float32, as transformers computes them, so that near
ties fall the same way.

This module decides; the scheduler owns the beams' sequences and blocks
(``engine.core.beam_groups`` rewrites them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.core.finish_reason import FinishReason
from engine.core.sampling_params import BeamSearch

# (token ids, their logprobs), most likely first: one beam's proposals for its next token.
Candidates = tuple[Sequence[int], Sequence[float]]


@dataclass(frozen=True)
class Continuation:
    """A running beam of the next step: beam ``parent`` (a position in the beams passed to ``step``) + a token."""

    parent: int
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens, the sum of their logprobs, its length-penalised score."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason


class BeamSearchState:
    """The search of one request: its finished hypotheses and whether it is over."""

    def __init__(self, params: BeamSearch, *, max_new_tokens: int, num_stop_tokens: int) -> None:
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.max_new_tokens = max_new_tokens
        # Enough candidates that ``width`` of them do not end even when every beam proposes its stop tokens.
        self.num_candidates = max(2, 1 + num_stop_tokens) * self.width
        self.finished: list[Hypothesis] = []   # best first, at most ``width``
        self.done = False

    def step(self, beams: Sequence[tuple[Sequence[int], float]], candidates: Sequence[Candidates],
             stop_reason: Callable[[int], FinishReason | None], at_length_limit: bool) -> list[Continuation]:
        """One step. ``beams``: each running beam's (output ids, cumulative logprob), all of the same length;
        ``candidates``: each beam's proposals; ``stop_reason(token)``: why appending ``token`` ends a beam (a
        stop token) or None; ``at_length_limit``: the next token reaches the length limit. Returns the beams
        of the next step, best first ([] once the search is ``done``)."""
        if self.done:
            raise ValueError("the beam search is over")
        scored: list[tuple[np.float32, int, int]] = []
        for b, ((_, cumulative), (token_ids, logprobs)) in enumerate(zip(beams, candidates, strict=True)):
            base = np.float32(cumulative)
            for token, logprob in zip(token_ids, logprobs, strict=True):
                score = np.float32(base + np.float32(logprob))
                if np.isfinite(score):   # a masked token (min_tokens) is never a candidate
                    scored.append((score, b, token))
        # transformers' topk over the flattened (beam, token) scores: ties go to the lower flat index.
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))
        length = len(beams[0][0]) + 1
        denominator = np.float32(length ** self.length_penalty)
        running: list[Continuation] = []
        ended: list[Hypothesis] = []
        for rank, (score, b, token) in enumerate(scored[:self.num_candidates]):
            reason = stop_reason(token) or (FinishReason.LENGTH if at_length_limit else None)
            if reason is None:
                if len(running) < self.width:
                    running.append(Continuation(b, token, float(score)))
            elif rank < self.width:   # an ending candidate below the first ``width`` is dropped
                ended.append(Hypothesis((*beams[b][0], token), float(score), float(score / denominator), reason))
        # Earlier hypotheses stay ahead of new ones with the same score (stable sort).
        self.finished = sorted(self.finished + ended, key=lambda h: -h.score)[:self.width]
        self.done = at_length_limit or not running or self._no_improvement(running[0], length)
        return [] if self.done else running

    def _no_improvement(self, best: Continuation, length: int) -> bool:
        """Whether the search stops with every hypothesis slot filled (transformers' early-stop heuristic)."""
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens   # the best a running beam could still score: at the longest
        best_possible = np.float32(best.cumulative_logprob) / np.float32(length ** self.length_penalty)
        return not best_possible > np.float32(min(h.score for h in self.finished))

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
