"""What the engine reports: per-step deltas from the core, whole results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.finish_reason import FinishReason
from engine.core.kv_transfer_params import RemoteKV
from engine.core.request import PromptLogprobs, RequestTimes, SequenceId

if TYPE_CHECKING:
    import torch


@dataclass
class EngineCoreOutput:
    """New tokens of one sequence of a request in one step (a delta, never the whole sequence)."""

    request_id: str
    new_token_ids: list[int]
    # One (logprob of the sampled token, {token id: logprob} top-k, the sampled token's rank) per new token, when
    # asked.
    new_logprobs: list[tuple[float, dict[int, float], int]] | None = None
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
    # A pooling request's result on its one output: float32 rows [rows, row_size] (engine.worker.pooling_runner).
    pooled: torch.Tensor | None = None
    # A prefill engine's do_remote_decode request whose first token did not end it, on its last output: where its
    # blocks are held for a decode engine (the sequence goes on there; its LENGTH is the core's one-token cap).
    kv_transfer: RemoteKV | None = None
    # A decode engine's request that pulled a prefill engine's blocks: how many, on its first output after the pull.
    kv_blocks_received: int = 0

    @property
    def finished(self) -> bool:
        """This sequence ended (its request may go on with other sequences: see ``request_finished``)."""
        return self.finish_reason is not None

    @property
    def seq_id(self) -> SequenceId:
        return SequenceId(self.request_id, self.index)


@dataclass
class Logprob:
    """One token's entry in the offline API's logprobs (vLLM's ``Logprob``): its log probability, its rank in the
    distribution (1 + the tokens more likely than it) and its text as decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shapes: one {token id: Logprob} per generated token (the sampled token first, then the top ones); for
# the prompt, None for its first token, then one such dict per token (the prompt's own token first).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobDicts = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: SampleLogprobs | None = None
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
    # vLLM's shape: None for the first prompt token, then {token id: Logprob} holding the prompt token and the
    # top prompt_logprobs alternatives. None when not asked.
    prompt_logprobs: PromptLogprobDicts | None = None
