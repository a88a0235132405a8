"""What the engine reports: per-step deltas from the core, whole results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.finish_reason import FinishReason
from engine.core.request import PromptLogprobs, RequestTimes, SequenceId


@dataclass
class EngineCoreOutput:
    """New tokens of one sequence of a request in one step (a delta, never the whole sequence)."""

    request_id: str
    new_token_ids: list[int]
    # One (logprob of the sampled token, {token id: logprob} top-k) per new token, when asked.
    new_logprobs: list[tuple[float, dict[int, float]]] | None = None
    finish_reason: FinishReason | None = None   # set on the sequence's last output only
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0                  # which of the request's n sequences
    # The core's word that the whole request has ended (every sequence of it): its last output, set once.
    request_finished: bool = False
    # Sum of the sequence's token logprobs, on its last output: with best_of, beam search, or logprobs asked.
    cumulative_logprob: float | None = None
    # With prompt_logprobs asked: on each sequence's first output (the same object for all of them).
    prompt_logprobs: PromptLogprobs | None = None
    # On the output with ``request_finished`` (None only when the engine failed and ended everything at once).
    times: RequestTimes | None = None

    @property
    def finished(self) -> bool:
        """This sequence ended (its request may go on with other sequences: see ``request_finished``)."""
        return self.finish_reason is not None

    @property
    def seq_id(self) -> SequenceId:
        return SequenceId(self.request_id, self.index)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    # vLLM's shape: None for the first prompt token, then {token id: logprob} holding the prompt token and the
    # top prompt_logprobs alternatives. None when not asked.
    prompt_logprobs: list[dict[int, float] | None] | None = None
