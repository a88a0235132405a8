"""Where each sequence of a reasoning model stands in its thinking (``SamplingParams.reasoning``), for the
sampler: its grammar applies once the thinking has ended, and a spent thinking budget forces the end token.

The state is read from the sequence's own output tokens (the core's): the thinking has ended once they hold the
end token. Each sequence remembers how far it has looked, so every token is looked at once, whatever the length
of the thinking.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the core's types, handed down by the executor: annotations only
    from engine.core.request import SequenceId
    from engine.core.sampling_params import ReasoningParams


class ThinkingTracker:
    """Per sequence: (output tokens looked at, whether the end token was among them); dropped by ``release``."""

    def __init__(self) -> None:
        self._seen: dict[SequenceId, tuple[int, bool]] = {}

    def has_ended(self, seq_id: SequenceId, reasoning: ReasoningParams, output_token_ids: Sequence[int]) -> bool:
        """Whether the sequence's thinking has ended: its output holds ``reasoning.end_token_id``."""
        looked, ended = self._seen.get(seq_id, (0, False))
        if ended:
            return True
        if looked > len(output_token_ids):   # not this sequence's history (a fork, a rewritten beam)
            looked = 0
        ended = reasoning.end_token_id in output_token_ids[looked:]
        self._seen[seq_id] = (len(output_token_ids), ended)
        return ended

    def forced_token(self, seq_id: SequenceId, reasoning: ReasoningParams,
                     output_token_ids: Sequence[int]) -> int | None:
        """The end token when the sequence has thought for its whole budget without ending; else None."""
        budget = reasoning.thinking_token_budget
        if budget is None or len(output_token_ids) < budget or self.has_ended(seq_id, reasoning, output_token_ids):
            return None
        return reasoning.end_token_id

    def release(self, seq_ids: Iterable[SequenceId]) -> None:
        for seq_id in seq_ids:
            self._seen.pop(seq_id, None)
