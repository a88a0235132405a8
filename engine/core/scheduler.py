"""Continuous batching: one token budget per step, chunked prefill, preemption by recompute.

There is no prefill phase and no decode phase: every request has
``num_computed_tokens`` catching up with ``num_tokens``. Each step the running
requests are served first, in queue order (a decode needs 1 token, an
unfinished prompt gets what is left of the budget after reserving one token for
each decode queued behind it, so decodes are never starved by a chunk), then
waiting requests are admitted while the budget, the ``max_num_seqs`` cap and
the free blocks allow. A running request that cannot get blocks preempts the
least important running request (the most recently admitted under fcfs; the
lowest priority under priority): its blocks are freed and it goes back to the
front of the waiting queue, keeping its output tokens, to be recomputed later
as one prefill.

A request with n > 1 runs as one sequence until its first sample, which is
taken n times: the scheduler then forks the other n - 1 sequences from it
(sharing its blocks, copy-on-write). Its sequences are named ``(request_id,
index)``; the scheduler alone decides when the whole request has ended and
says so on its last output (``EngineCoreOutput.request_finished``).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from common.errors import InvalidRequestError, QueueFullError
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.outputs import EngineCoreOutput
from engine.core.request import FinishReason, Request, RequestStatus, SequenceId

Logprob = tuple[float, dict[int, float]]


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``all_token_ids[start:start + num_new_tokens]``."""

    request: Request
    num_new_tokens: int
    start: int            # request.num_computed_tokens when scheduled
    sample: bool          # start + num_new_tokens == request.num_tokens: the runner samples for it
    # Tokens the runner samples for it: n for a request with n > 1 sampling for the first time, else 1.
    num_samples: int = 1

    @property
    def is_decode(self) -> bool:
        return self.sample and self.num_new_tokens == 1

    @property
    def sample_seq_ids(self) -> list[SequenceId]:
        """The sequences the runner samples a token for, one each: none unless ``sample``; the request's
        n sequences for the first sample of a request with n > 1 (its fork), else this sequence."""
        if not self.sample:
            return []
        r = self.request
        if self.num_samples == 1:
            return [r.seq_id]
        return [SequenceId(r.request_id, r.index + i) for i in range(self.num_samples)]


@dataclass
class SchedulerOutput:
    """What the runner executes in one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)   # decodes first, then prefill chunks
    num_batched_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): do before the forward pass
    preempted: list[SequenceId] = field(default_factory=list)
    # Sequences that finished or were aborted since the previous step.
    finished_request_ids: list[SequenceId] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0   # tokens served from the prefix cache to requests admitted this step

    @property
    def num_scheduled_tokens(self) -> dict[SequenceId, int]:
        return {s.request.seq_id: s.num_new_tokens for s in self.scheduled}


class Scheduler:
    """Owns the waiting and running queues and the block manager; drives every request's state.

    ``requests`` holds the sequences of every unfinished request, keyed by
    ``(request_id, index)``: the live ones (waiting, running or preempted), and
    those that ended while a sibling still runs (so that a request id stays in
    use until the whole request is done). A sequence's blocks are freed as soon
    as it ends. Sequences aborted through ``abort_request`` are returned by it
    and not reported again by ``update_from_output``: the caller reports them.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, *, eos_token_ids: set[int] | frozenset[int],
                 max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[SequenceId, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._by_priority = config.scheduling_policy == "priority"
        self._arrival_seq: dict[SequenceId, int] = {}   # ties of arrival_time, and the fcfs order
        self._next_seq = 0
        self._finished_ids: list[SequenceId] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0       # prompt tokens computed (recomputation after preemption included)
        self.num_generation_tokens = 0   # tokens sampled

    # ----- queries -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def prefix_cache_queries(self) -> int:
        return self.block_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.block_manager.prefix_cache_hits

    @property
    def capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str, index: int = 0) -> Request | None:
        """Sequence ``index`` of an unfinished request (it may itself have ended while a sibling runs)."""
        return self.requests.get(SequenceId(request_id, index))

    # ----- admission and abort ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises InvalidRequestError (naming the field) or QueueFullError; queues nothing
        then. The one place that checks a prompt against max_model_len and the KV cache, and a request id
        against the requests running."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if num_prompt > self.max_model_len:
            raise InvalidRequestError("prompt", f"the prompt has {num_prompt} tokens, more than max_model_len "
                                                f"{self.max_model_len}")
        if num_prompt > self.capacity_tokens:
            raise InvalidRequestError("prompt", f"{num_prompt} tokens do not fit in the KV cache "
                                                f"({self.capacity_tokens} tokens)")
        if request.index != 0 or len(request.sequences) != 1:
            raise ValueError(f"{request.seq_id}: only a new request's first sequence is added; forks make the others")
        if request.seq_id in self.requests:   # sequence 0 stays keyed until every sequence of its request ended
            raise InvalidRequestError("request_id", f"request {request.request_id!r} is already running")
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting (max_queued_requests={limit})")
        request.status = RequestStatus.WAITING
        self._track(request)
        self._insert(self.waiting, request, front=False)

    def abort_request(self, request_id: str, index: int | None = None, *,
                      reason: FinishReason = FinishReason.ABORT) -> list[Request]:
        """End a request's live sequences (``index`` None), or one of them, now, freeing their blocks.

        Returns the sequences ended ([] when none is live: unknown ids and ended sequences are ignored).
        A sequence of a request with n > 1 that its fork has not made yet ends at the fork (reported then,
        by ``update_from_output``); when that is every sequence of it, the request ends now.
        """
        first = self.requests.get(SequenceId(request_id))
        if first is None:
            return []
        n = first.sampling_params.n   # > 1 only before the fork
        if index is not None and n > 1:
            if not 0 <= index < n:
                return []
            first.aborted_before_fork.add(index)
            if len(first.aborted_before_fork) < n:
                return []
            index = None
        targets = [s for s in first.sequences if not s.is_finished and (index is None or s.index == index)]
        for request in targets:
            self._finish(request, reason)
        return targets

    def fork_request(self, parent: Request, index: int) -> Request:
        """A running copy of ``parent`` sharing its blocks (copy-on-write): sequence ``index`` of its request."""
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"only a running request can be forked, {parent.seq_id} is {parent.status.value}")
        seq_id = SequenceId(parent.request_id, index)
        if seq_id in self.requests:
            raise ValueError(f"{seq_id} already exists")
        seed = parent.sampling_params.seed
        params = parent.sampling_params.clone(n=1, seed=None if seed is None else seed + index)
        child = Request(parent.request_id, parent.prompt_token_ids, params, arrival_time=parent.arrival_time,
                        priority=parent.priority, index=index)
        child.sequences = parent.sequences
        child.sequences.append(child)
        child.copy_tokens_from(parent)
        child.output_logprobs = list(parent.output_logprobs)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.first_token_time = parent.first_token_time
        child.status = RequestStatus.RUNNING
        self.block_manager.fork(parent, child)
        self._track(child)
        self._insert(self.running, child, front=False)
        return child

    # ----- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []

        # A prefill chunk ahead of decodes in the queue (priority policy) leaves one token for each of them.
        num_pending_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 1:
                num_pending_decodes -= 1
                num_new = 1
            else:
                num_new = min(remaining, budget - num_pending_decodes)
                if num_new <= 0:
                    continue
            # Short of blocks: preempt from the tail, which this step has not scheduled yet, until it fits.
            while not self.block_manager.allocate(request, num_new):
                victim = self.running.pop()
                if victim is not request and victim.num_tokens - victim.num_computed_tokens == 1:
                    num_pending_decodes -= 1
                self._preempt(victim)
                out.preempted.append(victim.seq_id)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break   # it was the last running request
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        # Admitting while running requests are being evicted would only evict them again.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed = self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(request, num_new, computed):
                break   # strict queue order: later requests do not overtake the head
            self.waiting.pop(0)
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            out.num_prefix_hit_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self._insert(self.running, request, front=False)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        out.scheduled = [s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode]
        out.num_batched_tokens = sum(s.num_new_tokens for s in scheduled)
        out.block_copies = self.block_manager.pop_block_copies()
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[SequenceId, list[int]],
                           logprobs: dict[SequenceId, list[Logprob]] | None = None, *,
                           grammar_ended: dict[SequenceId, FinishReason] | None = None) -> list[EngineCoreOutput]:
        """Apply one executed step: advance progress, cache full blocks, append samples, finish and free.

        Returns one output per sequence that got tokens to report (forked ones
        included, after the sequence they were forked from): every token at once,
        or, under a stream interval of N, the first token at once, then groups of
        N, then the rest when the sequence finishes. ``sampled`` must hold tokens
        for every sequence of ``ScheduledRequest.sample_seq_ids``. ``grammar_ended``:
        constrained sequences that end with this step's token, and why (their grammar
        is complete: EOS, even under ignore_eos; their matcher failed: ERROR).
        """
        outputs: list[EngineCoreOutput] = []
        for s in out.scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue   # aborted after it was scheduled
            request.num_computed_tokens = s.start + s.num_new_tokens
            self.num_prompt_tokens += max(0, min(request.num_computed_tokens, request.num_prompt_tokens) - s.start)
            self.block_manager.cache_blocks(request, request.num_computed_tokens)
            seq_ids = s.sample_seq_ids
            if not seq_ids:
                continue
            missing = [seq_id for seq_id in seq_ids if not sampled.get(seq_id)]
            if missing:
                raise ValueError(f"no sampled token for {missing} (sampled: {sorted(sampled)})")
            seqs = [request]
            if len(seq_ids) > 1:
                # Fork before the first sequence appends, so each starts from its pre-sample state.
                seqs += [self.fork_request(request, seq_id.index) for seq_id in seq_ids[1:]]
                request.sampling_params = request.sampling_params.clone(n=1)
            aborted, request.aborted_before_fork = request.aborted_before_fork, set()
            for seq in seqs:
                if seq.index in aborted:
                    self._finish(seq, FinishReason.ABORT)
                else:
                    self._append(seq, sampled[seq.seq_id], logprobs.get(seq.seq_id) if logprobs else None,
                                 grammar_ended.get(seq.seq_id) if grammar_ended else None)
                report = self._report(seq)
                if report is not None:
                    outputs.append(report)
        return outputs

    # ----- helpers -------------------------------------------------------------------

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        sample = request.num_computed_tokens + num_new == request.num_tokens
        # n > 1 only until the fork: the forked sequences, and the first one after it, have n = 1.
        n = request.sampling_params.n if sample else 1
        return ScheduledRequest(request, num_new, request.num_computed_tokens, sample, n)

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks and queue it first in line; its outputs stay and are recomputed."""
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, victim, front=True)

    def _append(self, request: Request, tokens: list[int], lps: list[Logprob] | None,
                grammar_end: FinishReason | None = None) -> None:
        for j, token in enumerate(tokens):
            request.append_output_token(token)
            if lps is not None:
                request.output_logprobs.append(lps[j])
            self.num_generation_tokens += 1
            reason = self._stop_reason(request, token)
            # A grammar that ended with the last token says why better than a length limit reached with it.
            if grammar_end is not None and j == len(tokens) - 1 and reason in (None, FinishReason.LENGTH):
                reason = grammar_end
            if reason is not None:
                self._finish(request, reason)
                break
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()

    def _report(self, request: Request) -> EngineCoreOutput | None:
        """The tokens of ``request`` not yet reported, or None while its stream interval holds them back.

        The first token always goes at once (time to first token is never traded away), and a finished
        request reports whatever is left with its finish reason."""
        start = request.num_reported_tokens
        interval = max(request.sampling_params.stream_interval or 1, self.config.stream_interval)
        if (interval > 1 and start > 0 and request.finish_reason is None
                and request.num_output_tokens - start < interval):
            return None
        request.num_reported_tokens = request.num_output_tokens
        return EngineCoreOutput(request.request_id, request.output_token_ids[start:],
                                request.output_logprobs[start:] if request.output_logprobs else None,
                                request.finish_reason, request.num_prompt_tokens, request.num_cached_tokens,
                                index=request.index, request_finished=request.ends_request)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """Why ``request`` stops after appending ``token``; stop tokens are checked before length limits."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.EOS
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        # Its next step would need more blocks than the whole cache has: it can never be computed.
        if request.num_tokens > self.capacity_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """End one sequence now. The last of a request's sequences to end ends the request (``ends_request``,
        reported on its last output), and only then are its sequences dropped from ``requests``."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._arrival_seq[request.seq_id]
        self._finished_ids.append(request.seq_id)
        if all(s.is_finished for s in request.sequences):
            request.ends_request = True
            for seq in request.sequences:
                del self.requests[seq.seq_id]

    def _track(self, request: Request) -> None:
        self.requests[request.seq_id] = request
        self._arrival_seq[request.seq_id] = self._next_seq
        self._next_seq += 1

    def _key(self, request: Request) -> tuple[int, float, int]:
        return request.priority, request.arrival_time, self._arrival_seq[request.seq_id]

    def _insert(self, queue: list[Request], request: Request, *, front: bool) -> None:
        """Priority policy: keep ``queue`` sorted (best first). fcfs: append, or put a preempted request first."""
        if self._by_priority:
            bisect.insort(queue, request, key=self._key)
        elif front:
            queue.insert(0, request)
        else:
            queue.append(request)
