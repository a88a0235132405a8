"""Speculative decoding's proposers: what the runner verifies in one forward pass of the target model.

A proposer looks at the step the scheduler made and returns, for each row that has lookahead slots
(``ScheduledRequest.num_spec_tokens``), at most that many token ids that the target is likely to produce next.
Proposals are deterministic (a draft distribution that is one token): the runner accepts the longest prefix
that the target's own samples agree with, which keeps every output distributed exactly as without speculation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.core.request import SequenceId
    from engine.core.scheduler_output import ScheduledRequest


class Proposer(Protocol):
    # Whether it reads the target's hidden states (``observe``): the stage keeps every token's for it.
    wants_hidden: bool

    def propose(self, scheduled: list[ScheduledRequest]) -> list[np.ndarray]:
        """One int64 array per row of ``scheduled``: its proposed tokens (empty where it has no lookahead, or
        nothing worth proposing), at most ``num_spec_tokens`` long."""

    def accepted(self, seq_id: SequenceId, num_accepted: int) -> None:
        """How many of ``seq_id``'s proposed tokens the target accepted this step."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies of this step (a proposer with a KV cache of its own repeats them)."""

    def forget(self, seq_ids: list[SequenceId]) -> None:
        """Sequences that ended or were preempted: drop what was kept for them."""

    def fork(self, parent: SequenceId, child: SequenceId) -> None:
        """``child`` (n > 1) continues from ``parent``: it inherits what was kept for it."""

    def observe(self, scheduled: list[ScheduledRequest], row_tokens: list[int], kept: list[int],
                hidden: torch.Tensor) -> None:
        """The step's final hidden states of every flat token (only called when ``wants_hidden``)."""


class DraftLengths:
    """How many tokens to propose for each sequence, adapted to how many it had accepted (the heuristic of
    transformers' assisted generation): two more after a proposal accepted whole, one fewer after a rejection,
    between 1 and the configured number. Proposals rarely accepted then cost one verified token per step, not
    ``num_speculative_tokens`` of the step's rows (and logits); exactness does not depend on it."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.most = num_speculative_tokens
        self._length: dict[SequenceId, int] = {}
        self._proposed: dict[SequenceId, int] = {}

    def limit(self, seq_id: SequenceId, lookahead: int) -> int:
        return min(lookahead, self._length.get(seq_id, self.most))

    def proposed(self, seq_id: SequenceId, num: int) -> None:
        self._proposed[seq_id] = num

    def accepted(self, seq_id: SequenceId, num_accepted: int) -> None:
        num = self._proposed.pop(seq_id, 0)
        if num == 0:
            return
        length = self._length.get(seq_id, self.most)
        self._length[seq_id] = min(self.most, length + 2) if num_accepted == num else max(1, length - 1)

    def forget(self, seq_ids: list[SequenceId]) -> None:
        for seq_id in seq_ids:
            self._length.pop(seq_id, None)
            self._proposed.pop(seq_id, None)
