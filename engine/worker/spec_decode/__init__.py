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
    from engine.core.request import SequenceId
    from engine.core.scheduler_output import ScheduledRequest


class Proposer(Protocol):
    def propose(self, scheduled: list[ScheduledRequest]) -> list[np.ndarray]:
        """One int64 array per row of ``scheduled``: its proposed tokens (empty where it has no lookahead, or
        nothing worth proposing), at most ``num_spec_tokens`` long."""

    def accepted(self, seq_id: SequenceId, num_accepted: int) -> None:
        """How many of ``seq_id``'s proposed tokens the target accepted this step."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies of this step (a proposer with a KV cache of its own repeats them)."""

    def forget(self, seq_ids: list[SequenceId]) -> None:
        """Sequences that ended or were preempted: drop what was kept for them."""
