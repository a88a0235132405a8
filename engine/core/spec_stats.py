"""Speculative decoding's counters, summed over the engine's life (vLLM's ``SpecDecodingStats``).

A *draft* is one sequence's proposal in one step that held at least one token; its tokens are *draft tokens*;
those the target model agreed with are *accepted* (the token the target sampled after them is not counted).
Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the tokens a
sequence gains per verifying step, vLLM's convention).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [num_spec_tokens]: drafts whose token at each position was accepted (position 0 first).
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's step: ``num_draft_tokens`` proposed, the first ``num_accepted`` of them accepted."""
        if num_draft_tokens <= 0:
            return
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"{num_accepted} accepted of {num_draft_tokens} drafted (at most "
                             f"{self.num_spec_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
