"""The engine's one owner of per-request state (token ids, progress, blocks, status)."""

from __future__ import annotations

import enum
import time

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence ended. Text-level reasons (stop strings) live outside the core."""

    EOS = "eos"              # the model's end-of-sequence token
    STOP = "stop"            # one of ``stop_token_ids``
    LENGTH = "length"        # max_tokens or max_model_len reached
    ABORT = "abort"          # cancelled by the caller
    ERROR = "error"          # the engine failed while running it


class Request:
    """One sequence the engine schedules.

    ``num_computed_tokens`` catches up with ``num_tokens`` (chunked prefill and
    decode are the same thing); ``block_ids`` is the block table, written only
    by the block manager.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        parent_id: str | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        # For n > 1: children forked from a parent share its blocks; index orders the n outputs.
        self.parent_id = parent_id
        self.index = index
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Each entry: (sampled token logprob, {token id: logprob} of the top-k) when logprobs asked.
        self.output_logprobs: list[tuple[float, dict[int, float]]] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0           # prompt tokens served from the prefix cache (first schedule)
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []    # chained hashes of full blocks, filled by the block manager
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids}, {self.status.value})")
