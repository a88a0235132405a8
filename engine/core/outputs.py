"""What the engine reports: per-step deltas from the core, whole results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import FinishReason


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step (a delta, never the whole sequence)."""

    request_id: str
    new_token_ids: list[int]
    # One (logprob of the sampled token, {token id: logprob} top-k) per new token, when asked.
    new_logprobs: list[tuple[float, dict[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
