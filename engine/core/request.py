"""The engine's one owner of per-request state (token ids, progress, blocks, status)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.core.beam import BeamSearchState
from engine.core.finish_reason import FinishReason
from engine.core.kv_transfer_params import RemoteKV
from engine.core.lora_request import LoRARequest
from engine.core.multimodal import MultiModalItem
from engine.core.pooling_params import PoolingSpec
from engine.core.sampling_params import SamplingParams

TOKEN_DTYPE = np.int32


@dataclass(frozen=True)
class RequestTimes:
    """When a request passed each stage, in ``time.monotonic()`` seconds (for metrics and trace spans).

    Of the whole request: with n > 1, best_of or beam search, the earliest of its sequences for
    ``first_scheduled`` and ``first_token``. None: the request never got that far (aborted while
    waiting, or failed)."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float
    num_preemptions: int = 0        # times any of its sequences was preempted
    num_generation_tokens: int = 0  # tokens sampled for it, all sequences together


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The log-probability of each prompt token given the ones before it (vLLM's ``prompt_logprobs``).

    ``token_ids`` is the whole prompt; the other arrays start at its second token (nothing precedes the
    first): ``logprobs[i]`` is that of ``token_ids[i + 1]``, and ``top_ids[i]`` / ``top_logprobs[i]`` the k
    most likely tokens at that position, most likely first. Raw model distribution, float32.
    """

    token_ids: np.ndarray      # [P] int32
    logprobs: np.ndarray       # [P - 1] float32
    top_ids: np.ndarray        # [P - 1, k] int64
    top_logprobs: np.ndarray   # [P - 1, k] float32
    # [P - 1] int64: each token's rank, 1 + the tokens more likely than it (vLLM's); None where not computed.
    ranks: np.ndarray | None = None


# What the runner computes for one prefill chunk: (index in the prompt of the first token covered, its logprob
# and those of the tokens after it [m], top ids [m, k], top logprobs [m, k], their ranks [m]). The core joins a
# prompt's chunks.
PromptLogprobsChunk = tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, order=True, slots=True)
class SequenceId:
    """Names one sequence of a request: ``index`` orders the n outputs of a request with n > 1 (0 for n = 1)."""

    request_id: str
    index: int = 0


class Request:
    """One sequence the engine schedules: a request, or one of the n sequences of a request with n > 1.

    ``num_computed_tokens`` catches up with ``num_tokens`` (chunked prefill and
    decode are the same thing); ``block_ids`` is the block table, written only
    by the block manager. The sequences of a request with n > 1 share its
    ``request_id`` and are told apart by ``index``: the first (index 0) runs
    alone until its first sample, when the scheduler forks the others from it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        sampling_params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        index: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        resumed_output_tokens: int = 0,
    ) -> None:
        """``resumed_output_tokens``: the last this-many ids of ``prompt_token_ids`` are output the request already
        produced on another engine (request migration): they become its first outputs, already reported, and are
        recomputed with the prompt as a preempted request's are."""
        self.request_id = request_id
        self.index = index
        self.seq_id = SequenceId(request_id, index)
        # Token ids live in one growable int32 buffer: prompts arrive as arrays from the engine servicer
        # (shared memory or protobuf, never as Python ints), and the runner copies slices of it as is.
        prompt = np.asarray(prompt_token_ids, dtype=TOKEN_DTYPE)
        if prompt.ndim != 1:
            raise ValueError(f"prompt_token_ids: one-dimensional ids expected, got shape {prompt.shape}")
        self._tokens = np.empty(len(prompt) + min(sampling_params.max_tokens or 16, 4096), dtype=TOKEN_DTYPE)
        self._tokens[:len(prompt)] = prompt
        self._num_tokens = len(prompt)
        num_prompt = len(prompt) - resumed_output_tokens
        self.prompt_token_ids: np.ndarray = self._tokens[:num_prompt]  # a view: the prompt never changes
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        # The LoRA adapter every sequence of the request runs through (None: the base model).
        self.lora_request = lora_request
        # vLLM's cache_salt: an extra key of the first block's hash, so only requests with the same salt share
        # cached blocks (None: no salt).
        self.cache_salt = cache_salt
        # A pooling request's task and parameters (None: a generation request): one step over the whole prompt.
        self.pooling: PoolingSpec | None = None
        # The prompt's images, in prompt order (engine.core.multimodal; empty: text only).
        self.mm_items: tuple[MultiModalItem, ...] = ()
        # Prefill/decode disaggregation (engine.core.disagg): the producer's blocks a consumer's request pulls, or a
        # producer's do_remote_decode (None: neither); ``kv_handoff``: a producer's request whose one-token cap is
        # the core's, not the client's, so reaching it hands the sequence on; ``kv_transfer_out``: where its
        # blocks are held, on its last output.
        self.kv_transfer: RemoteKV | None = None
        self.kv_handoff = False
        self.kv_transfer_out: RemoteKV | None = None
        self.kv_blocks_received = 0   # a consumer's: blocks pulled for it, said once on its next output
        # Every sequence of the request, this one included: one list, shared by all of them (a fork appends).
        self.sequences: list[Request] = [self]
        # Indexes aborted before the fork made their sequences (only on index 0 while n > 1): they end at the fork.
        self.aborted_before_fork: set[int] = set()
        self.output_token_ids: list[int] = prompt[num_prompt:].tolist()
        # Each entry: (sampled token logprob, {token id: logprob} of the top-k) when logprobs asked.
        self.output_logprobs: list[tuple[float, dict[int, float], int]] = []
        # Sum of the sampled tokens' logprobs (raw model distribution), kept when the sampler reports them.
        self.cumulative_logprob = 0.0
        # best_of and beam search: nothing is reported until the request ends, then its ``num_returned`` best
        # sequences (forks keep both, their params lose best_of as they lose n).
        self.holds_outputs = sampling_params.holds_outputs
        self.num_returned = sampling_params.n
        # Beam search: the search's state, one object shared by the request's beams (None otherwise).
        self.beam: BeamSearchState | None = None
        # With prompt_logprobs asked: the chunks computed so far, joined into ``prompt_logprobs`` once they
        # cover the prompt (then sent with each sequence's first output).
        self.prompt_logprob_chunks: list[PromptLogprobsChunk] = []
        self.prompt_logprobs: PromptLogprobs | None = None
        if sampling_params.prompt_logprobs is not None and num_prompt == 1:
            self._join_prompt_logprobs()   # one token: nothing precedes it, nothing to compute
        # Output tokens already in an EngineCoreOutput (stream interval), or delivered by the engine it moved from.
        self.num_reported_tokens = resumed_output_tokens
        self.num_computed_tokens = 0
        # Async scheduling: tokens a step still in flight samples for this sequence. The next step is scheduled
        # as if they were known (``num_planned_tokens``); the runner feeds them from that step's output.
        self.num_pending = 0
        self.num_cached_tokens = 0           # prompt tokens served from the prefix cache (first schedule)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, filled by the block manager
        self.num_seen_blocks = 0             # leading blocks the block manager's cache_blocks has looked at
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # Set by the scheduler when this sequence's end was its request's end (the last of its sequences).
        self.ends_request = False
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # The first-token wait admission expected for it (engine.core.admission; None: it had no estimate).
        self.expected_wait_s: float | None = None

    def times(self) -> RequestTimes:
        """When the whole request (all of ``sequences``) passed each stage, as of now: its end."""
        seqs = self.sequences
        scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
        first = [s.first_token_time for s in seqs if s.first_token_time is not None]
        return RequestTimes(self.arrival_time, min(scheduled, default=None), min(first, default=None),
                            time.monotonic(), sum(s.num_preemptions for s in seqs),
                            sum(s.num_output_tokens for s in seqs))

    @property
    def lora_id(self) -> int | None:
        """The adapter's ``lora_int_id`` (the key of its weights and of its prefix-cache blocks), None: base."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def all_token_ids(self) -> np.ndarray:
        """Prompt then output ids, int32 (a view of the buffer; valid until the next append)."""
        return self._tokens[:self._num_tokens]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_planned_tokens(self) -> int:
        """``num_tokens`` and the pending ones: what the scheduler plans with (``num_pending``)."""
        return self._num_tokens + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked and not all computed yet: every prompt position must be run (no prefix-cache
        hit may skip one)."""
        return self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Keep one chunk's prompt logprobs; the chunks covering the whole prompt become ``prompt_logprobs``."""
        if not self.needs_prompt_logprobs:
            return
        first = chunk[0]
        expected = 1 + sum(len(c[1]) for c in self.prompt_logprob_chunks)
        if first != expected:
            raise ValueError(f"{self.seq_id}: prompt logprobs from token {first}, expected {expected}")
        self.prompt_logprob_chunks.append(chunk)
        if expected + len(chunk[1]) == self.num_prompt_tokens:
            self._join_prompt_logprobs()

    def _join_prompt_logprobs(self) -> None:
        chunks, self.prompt_logprob_chunks = self.prompt_logprob_chunks, []
        k = self.sampling_params.prompt_logprobs or 0
        self.prompt_logprobs = PromptLogprobs(
            token_ids=self.prompt_token_ids.copy(),
            logprobs=np.concatenate([c[1] for c in chunks]) if chunks else np.empty(0, np.float32),
            top_ids=np.concatenate([c[2] for c in chunks]) if chunks else np.empty((0, k), np.int64),
            top_logprobs=np.concatenate([c[3] for c in chunks]) if chunks else np.empty((0, k), np.float32),
            ranks=np.concatenate([c[4] for c in chunks]) if chunks else np.empty(0, np.int64))

    def reset_prompt_logprobs(self) -> None:
        """Drop partial prompt logprobs (a preemption: the prompt is computed again from its start)."""
        self.prompt_logprob_chunks = []

    def append_output_token(self, token_id: int) -> None:
        if self._num_tokens == len(self._tokens):
            grown = np.empty(2 * len(self._tokens), dtype=TOKEN_DTYPE)
            grown[:self._num_tokens] = self._tokens[:self._num_tokens]
            self._tokens = grown
            self.prompt_token_ids = grown[:len(self.prompt_token_ids)]
        self._tokens[self._num_tokens] = token_id
        self._num_tokens += 1
        self.output_token_ids.append(token_id)

    def copy_tokens_from(self, other: Request) -> None:
        """Take ``other``'s ids and outputs (a fork: the child continues from the parent's state)."""
        self._tokens = other._tokens.copy()
        self._num_tokens = other._num_tokens
        self.prompt_token_ids = self._tokens[:len(other.prompt_token_ids)]
        self.output_token_ids = list(other.output_token_ids)
        self.output_logprobs = list(other.output_logprobs)
        self.cumulative_logprob = other.cumulative_logprob

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, index={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids}, {self.status.value})")
