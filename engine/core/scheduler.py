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
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, QueueFullError
from engine.core.outputs import EngineCoreOutput
from engine.core.request import FinishReason, Request, RequestStatus

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


@dataclass
class SchedulerOutput:
    """What the runner executes in one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)   # decodes first, then prefill chunks
    num_batched_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): do before the forward pass
    preempted: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the previous step: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0   # tokens served from the prefix cache to requests admitted this step

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request.request_id: s.num_new_tokens for s in self.scheduled}


class Scheduler:
    """Owns the waiting and running queues and the block manager; drives every request's state.

    ``requests`` holds every unfinished request (waiting, running or
    preempted). Finished requests are dropped at once and their blocks freed.
    Requests aborted through ``abort_request`` are returned by it and not
    reported again by ``update_from_output``: the caller reports them.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, *, eos_token_ids: set[int] | frozenset[int],
                 max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._by_priority = config.scheduling_policy == "priority"
        self._arrival_seq: dict[str, int] = {}   # ties of arrival_time, and the fcfs order
        self._next_seq = 0
        self._finished_ids: list[str] = []
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

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ----- admission and abort ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises InvalidRequestError("prompt", ...) or QueueFullError; queues nothing then."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if num_prompt > self.max_model_len:
            raise InvalidRequestError("prompt", f"{num_prompt} tokens is longer than the maximum model length "
                                                f"({self.max_model_len})")
        if num_prompt > self.capacity_tokens:
            raise InvalidRequestError("prompt", f"{num_prompt} tokens do not fit in the KV cache "
                                                f"({self.capacity_tokens} tokens)")
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting (max_queued_requests={limit})")
        request.status = RequestStatus.WAITING
        self._track(request)
        self._insert(self.waiting, request, front=False)

    def abort_request(self, request_id: str) -> list[Request]:
        """Abort a request and its forked children, freeing their blocks now. Returns them ([] if none live)."""
        targets = [r for r in self.requests.values() if r.request_id == request_id or r.parent_id == request_id]
        for request in targets:
            self._finish(request, FinishReason.ABORT)
        return targets

    def fork_request(self, parent: Request, child_id: str, index: int) -> Request:
        """A running copy of ``parent`` sharing its blocks (copy-on-write), as output ``index`` of n."""
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"only a running request can be forked, {parent.request_id} is {parent.status.value}")
        if child_id in self.requests:
            raise InvalidRequestError("request_id", f"{child_id!r} is already in use")
        seed = parent.sampling_params.seed
        params = parent.sampling_params.clone(n=1, seed=None if seed is None else seed + index)
        child = Request(child_id, parent.prompt_token_ids, params, arrival_time=parent.arrival_time,
                        priority=parent.priority, parent_id=parent.request_id, index=index)
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
                out.preempted.append(victim.request_id)
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

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           logprobs: dict[str, list[Logprob]] | None = None) -> list[EngineCoreOutput]:
        """Apply one executed step: advance progress, cache full blocks, append samples, finish and free.

        Returns one output per request that got tokens to report (forked children
        included, after their parent): every token at once, or, under a stream
        interval of N, the first token at once, then groups of N, then the rest
        when the request finishes. ``sampled[id]`` must hold
        ``num_samples`` tokens for every request scheduled with ``sample``.
        """
        outputs: list[EngineCoreOutput] = []
        for s in out.scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue   # aborted after it was scheduled
            request.num_computed_tokens = s.start + s.num_new_tokens
            self.num_prompt_tokens += max(0, min(request.num_computed_tokens, request.num_prompt_tokens) - s.start)
            self.block_manager.cache_blocks(request, request.num_computed_tokens)
            if not s.sample:
                continue
            tokens = sampled.get(request.request_id)
            if not tokens or len(tokens) != s.num_samples:
                raise ValueError(f"{request.request_id}: expected {s.num_samples} sampled tokens, got {tokens!r}")
            lps = logprobs.get(request.request_id) if logprobs is not None else None
            children: list[Request] = []
            if s.num_samples > 1:
                # Fork before the parent appends, so each child starts from the parent's pre-sample state.
                children = [self.fork_request(request, f"{request.request_id}#{i}", i)
                            for i in range(1, s.num_samples)]
                request.sampling_params = request.sampling_params.clone(n=1)
            for req, i in ((request, 0), *((child, i) for i, child in enumerate(children, start=1))):
                self._append(req, tokens[i:i + 1], lps[i:i + 1] if lps else None)
                report = self._report(req)
                if report is not None:
                    outputs.append(report)
        return outputs

    # ----- helpers -------------------------------------------------------------------

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        sample = request.num_computed_tokens + num_new == request.num_tokens
        n = request.sampling_params.n if sample and request.parent_id is None else 1
        return ScheduledRequest(request, num_new, request.num_computed_tokens, sample, n)

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks and queue it first in line; its outputs stay and are recomputed."""
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, victim, front=True)

    def _append(self, request: Request, tokens: list[int], lps: list[Logprob] | None) -> None:
        for j, token in enumerate(tokens):
            request.append_output_token(token)
            if lps is not None:
                request.output_logprobs.append(lps[j])
            self.num_generation_tokens += 1
            reason = self._stop_reason(request, token)
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
                                request.finish_reason, request.num_prompt_tokens, request.num_cached_tokens)

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
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        del self._arrival_seq[request.request_id]
        self._finished_ids.append(request.request_id)

    def _track(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._arrival_seq[request.request_id] = self._next_seq
        self._next_seq += 1

    def _key(self, request: Request) -> tuple[int, float, int]:
        return request.priority, request.arrival_time, self._arrival_seq[request.request_id]

    def _insert(self, queue: list[Request], request: Request, *, front: bool) -> None:
        """Priority policy: keep ``queue`` sorted (best first). fcfs: append, or put a preempted request first."""
        if self._by_priority:
            bisect.insort(queue, request, key=self._key)
        elif front:
            queue.insert(0, request)
        else:
            queue.append(request)
