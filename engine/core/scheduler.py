"""Continuous batching: one token budget per step, chunked prefill, preemption by recompute.

There is no prefill phase and no decode phase: every request has ``num_computed_tokens`` catching up with
``num_tokens``. Each step the running requests are served first, in queue order (a decode needs 1 token, an
unfinished prompt gets what is left of the budget after reserving one token for each decode queued behind it, so
decodes are never starved by a chunk), then waiting requests are admitted while the budget, the ``max_num_seqs``
cap and the free blocks allow. A running request that cannot get blocks preempts the least important running
request (the most recently admitted under fcfs; the lowest priority under priority): its blocks are freed and it
goes back to the front of the waiting queue, keeping its output tokens, to be recomputed later as one prefill.
Under the priority policy a waiting request with a strictly better priority that finds no seat (``max_num_seqs``)
or no blocks preempts the worst running one the same way, and takes its place in the same step.

LoRA: the running sequences use at most ``max_loras`` distinct adapters (the base model counts as none), the slots
the runner holds adapters' weights in. A waiting request whose adapter would be one too many is skipped for the
step, not blocking the requests behind it whose adapter fits, and keeps its place in the queue (vLLM v1's rule);
preemption only ever shrinks the set.

A request with n > 1 runs as one sequence until its first sample, which is taken n times: the scheduler then forks
the other n - 1 sequences from it (sharing its blocks, copy-on-write). Its sequences are named ``(request_id,
index)``; the scheduler alone decides when the whole request has ended and says so on its last output
(``EngineCoreOutput.request_finished``).

best_of forks its sequences the same way but holds their outputs: when the last ends, the ``n`` with the highest
cumulative logprob are reported (``engine.core.reports``). Beam search keeps ``width`` beams of one request that
are scheduled, preempted and ended together (``engine.core.beam_groups``).

A preempted request is not chosen as a victim again before it has sampled a token since, and a new request whose
expected first-token wait exceeds ``max_expected_ttft_ms`` is refused (``engine.core.admission``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from common.errors import InvalidRequestError, QueueFullError
from engine.config import EngineConfig
from engine.core.admission import QUEUE_FULL, AdmissionControl, PreemptionGuard
from engine.core.beam import Candidates
from engine.core.beam_groups import BeamGroups
from engine.core.block_hashing import make_block_hasher
from engine.core.block_manager import BlockManager
from engine.core.disagg import DisaggConnector, transfer_hash_environ
from engine.core.finish_reason import FinishReason
from engine.core.kv_offload import OffloadConnector
from engine.core.outputs import EngineCoreOutput
from engine.core.reports import best_of_outputs, delta_output
from engine.core.request import PromptLogprobsChunk, Request, RequestStatus, SequenceId
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.worker.kv_transports import KVSource

if TYPE_CHECKING:
    import torch

Logprob = tuple[float, dict[int, float], int]


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
                 max_model_len: int, reclaim_window: int | None = None, kv_offload_slots: int = 0,
                 kv_block_bytes: int = 0, kv_source: KVSource | None = None) -> None:
        """``reclaim_window``: every layer of the model attends over this many last positions: a running
        sequence's blocks before its window are given back as it goes. ``kv_offload_slots``: the blocks the
        KV offload tier holds (``config.kv_offloading_config``; ``engine.core.kv_offload.num_tier_slots``).
        ``kv_block_bytes``: one block in every layer; ``kv_source``: where consumers reach this producer's cache
        (prefill/decode disaggregation, ``config.kv_transfer_config``; ``engine.core.disagg``)."""
        self.config = config
        self.reclaim_window = reclaim_window
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        events = config.kv_events_config
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            hash_fn=make_block_hasher(config.prefix_caching_hash_algo, environ=transfer_hash_environ(config)),
            enable_kv_cache_events=events is not None and events.enable_kv_cache_events)
        # A KV offload tier: evicted blocks are stored there and loaded back on a prefix miss (None: off).
        self.kv_offload = None if config.kv_offloading_config is None else OffloadConnector(
            config.kv_offloading_config, self.block_manager, kv_offload_slots,
            requeue=lambda r: self._insert(self.waiting, r, front=True),
            enable_events=events is not None and events.enable_kv_cache_events)
        # Prefill/decode disaggregation: blocks held for a decode engine, or pulled from a prefill engine (None: off).
        self.kv_transfer = None if config.kv_transfer_config is None else DisaggConnector(
            config.kv_transfer_config, self.block_manager, block_bytes=kv_block_bytes, source=kv_source,
            requeue=lambda r: self._insert(self.waiting, r, front=True))
        # The connector whose requests wait for blocks being brought in (the config allows one at a time).
        self.kv_loader: OffloadConnector | DisaggConnector | None = self.kv_offload or self.kv_transfer
        self.beam_groups = BeamGroups(self.block_manager, eos_token_ids=self.eos_token_ids,
                                      max_model_len=max_model_len, fork=self.fork_request, finish=self._finish)
        self.requests: dict[SequenceId, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._by_priority = config.scheduling_policy == "priority"
        # Distinct LoRA adapters the running sequences may use (each needs a slot of the runner's); None: LoRA off.
        self._max_loras = None if config.lora_config is None else config.lora_config.max_loras
        # Tokens a decode may propose and verify in one step (speculative decoding; 0: off).
        spec = config.speculative_config
        self._spec_tokens = 0 if spec is None else spec.num_speculative_tokens
        # Further decode passes a row may run in one step (multi-step decode; 0: off, the config refuses both).
        self._extra_steps = config.num_scheduler_steps - 1
        self._arrival_seq: dict[SequenceId, int] = {}   # ties of arrival_time, and the fcfs order
        self._next_seq = 0
        self._finished_ids: list[SequenceId] = []
        self.ended: list[SequenceId] = []   # the sequences the last update_from_output ended
        self.num_preemptions = 0
        self.admission = AdmissionControl(config.max_expected_ttft_ms, config.max_num_batched_tokens)
        self.preemption_guard = PreemptionGuard()
        self.num_prompt_tokens = 0       # prompt tokens computed (recomputation after preemption included)
        self.num_generation_tokens = 0   # tokens sampled

    # ----- queries -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, those whose blocks an offload tier is loading included (vLLM counts them too)."""
        return len(self.waiting) + (0 if self.kv_loader is None else self.kv_loader.num_loading)

    @property
    def num_free_seats(self) -> int:
        """Sequences the next step may still admit (``max_num_seqs`` minus running; none when forks overran it)."""
        return max(0, self.config.max_num_seqs - len(self.running))

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
        return bool(self.waiting or self.running or (self.kv_loader is not None and self.kv_loader.num_loading))

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
        if request.pooling is not None and num_prompt > self.config.max_num_batched_tokens:
            raise InvalidRequestError("prompt", f"a pooling request runs its whole prompt in one step: {num_prompt} "
                                                "tokens exceed max_num_batched_tokens "
                                                f"{self.config.max_num_batched_tokens}")
        if request.index != 0 or len(request.sequences) != 1:
            raise ValueError(f"{request.seq_id}: only a new request's first sequence is added; forks make the others")
        if request.seq_id in self.requests:   # sequence 0 stays keyed until every sequence of its request ended
            raise InvalidRequestError("request_id", f"request {request.request_id!r} is already running")
        # The bound counts what the next step cannot seat, not len(waiting): a burst added before any step is
        # otherwise refused by an idle engine with free seats. A new request with n > 1 or beam search is one
        # sequence until its first sample (its forks take seats then), so it counts one, as the step's seat
        # check counts it.
        limit = self.config.max_queued_requests
        free = self.num_free_seats
        if limit is not None and len(self.waiting) + 1 - free > limit:   # unseated once this one is in
            self.admission.refused[QUEUE_FULL] += 1
            raise QueueFullError(f"the request queue is full: {len(self.waiting)} requests wait for {free} free "
                                 f"seats (max_num_seqs={self.config.max_num_seqs}) and at most {limit} may wait "
                                 f"beyond them (max_queued_requests={limit})")
        request.expected_wait_s = self.admission.check(num_prompt, self.waiting, self.running, free)
        if request.sampling_params.beam_search is not None:
            request.beam = self.beam_groups.new_search(request)
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
        if first is None:   # ended; a producer may still hold its blocks for a decode engine
            if self.kv_transfer is not None:
                self.kv_transfer.release(request_id)
            return []
        if first.holds_outputs:
            index = None   # which sequences it reports is decided at its end: one of them cannot end alone
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
        params = parent.sampling_params.clone(n=1, best_of=None, seed=None if seed is None else seed + index)
        child = Request(parent.request_id, parent.prompt_token_ids, params, arrival_time=parent.arrival_time,
                        priority=parent.priority, index=index, lora_request=parent.lora_request,
                        cache_salt=parent.cache_salt)
        child.sequences = parent.sequences
        child.sequences.append(child)
        child.copy_tokens_from(parent)
        child.holds_outputs, child.num_returned, child.beam = parent.holds_outputs, parent.num_returned, parent.beam
        child.prompt_logprobs = parent.prompt_logprobs
        child.mm_items = parent.mm_items
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
        if self.kv_transfer is not None:
            self.kv_transfer.expire()
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []

        # A unit is a request's sequence, or all the beams of a beam search: scheduled and preempted as one.
        units = self.beam_groups.units(self.running)
        # A prefill chunk ahead of decodes in the queue (priority policy) leaves one token for each of them.
        num_pending_decodes = sum(1 for r in self.running if r.num_planned_tokens - r.num_computed_tokens == 1)
        u = 0
        holding = False   # a running unit waits for blocks this step
        while u < len(units) and budget > 0:
            unit = units[u]
            u += 1
            num_pending_decodes -= sum(1 for r in unit if r.num_planned_tokens - r.num_computed_tokens == 1)
            if any(r.num_pending and self._ends_by_length(r) for r in unit):
                continue   # the step in flight gives it its last token: nothing to compute after it
            plan = self.beam_groups.plan(unit, budget, num_pending_decodes)
            if not plan:
                continue
            # Short of blocks: preempt from the tail, which this step has not scheduled yet, until it fits.
            preempted_self = held = False
            lookahead: list[int] = []
            room = budget - sum(num_new for _, num_new in plan) - num_pending_decodes
            for request, num_new in plan:
                spec = self._lookahead(request, num_new, min(self._spec_tokens, room) if self._spec_tokens
                                       else self._extra_steps)
                room -= spec
                while not preempted_self and not held and not self.block_manager.allocate(request, num_new + spec):
                    if spec:   # speculation gives way before anyone is preempted for it
                        room += spec
                        spec = 0
                        continue
                    pick = self.preemption_guard.victim_index(units, u - 1, can_wait=bool(scheduled))
                    if pick is None:   # protected from preemption: it waits for blocks, the others run
                        held = True
                        break
                    victims = units.pop(pick)
                    if victims is not unit:
                        num_pending_decodes -= sum(1 for r in victims
                                                   if r.num_planned_tokens - r.num_computed_tokens == 1)
                    preempted_self = victims is unit
                    for victim in victims:
                        self.running.remove(victim)
                        self._preempt(victim)
                        out.preempted.append(victim.seq_id)
                lookahead.append(spec)
            if preempted_self:
                u -= 1   # the units after it move up
                continue
            if held:
                holding = True
                continue
            for (request, num_new), spec in zip(plan, lookahead):
                row = ScheduledRequest.of(request, num_new)
                if self._spec_tokens:
                    row.num_spec_tokens = spec
                else:
                    row.num_lookahead_steps = spec
                scheduled.append(row)
                budget -= row.num_budget_tokens

        # Admitting while running requests are being evicted (or wait for blocks) would only evict them again.
        admit = not out.preempted and not holding
        loras = self._running_loras()
        skipped: list[Request] = []   # waiting units whose adapter would be one too many this step
        while admit and self.waiting and budget > 0:
            unit = self.beam_groups.units(self.waiting[:1])[0]
            lora_id = unit[0].lora_id
            if not self._lora_fits(loras, lora_id):
                # vLLM's rule: set aside, so that the requests behind it whose adapter fits still run.
                for request in unit:
                    self.waiting.remove(request)
                skipped += unit
                continue
            if unit[0].pooling is not None and unit[0].num_prompt_tokens > budget:
                break   # a pooling prompt runs whole, in one step: it waits for a step with room for all of it
            if self.kv_loader is not None and self.kv_loader.start_load(unit):
                self.waiting.remove(unit[0])   # back at the head once its blocks are loaded
                continue
            has_seat = len(self.running) + len(unit) <= self.config.max_num_seqs
            admitted = self.beam_groups.admit(unit, budget) if has_seat else None
            if admitted is None:
                # No seat or too few blocks: a better-priority request makes room, else strict queue order
                # (later requests do not overtake the head).
                freed = self._preempt_for(unit[0], scheduled, out)
                if freed is None:
                    break
                budget += freed
                loras = self._running_loras()   # the victims' adapters may have left the step
                continue
            for request, num_new, num_cached in admitted:
                self.waiting.remove(request)
                request.num_computed_tokens = num_cached
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.monotonic()
                    request.num_cached_tokens = num_cached
                out.num_prefix_hit_tokens += num_cached
                request.status = RequestStatus.RUNNING
                self._insert(self.running, request, front=False)
                if loras is not None and lora_id is not None:
                    loras.add(lora_id)
                if num_new:
                    scheduled.append(ScheduledRequest.of(request, num_new))
                    budget -= num_new
            # Room was just made for it: the victim (a prefix hit can fit it again) waits for the next step.
            admit = not out.preempted
        # The skipped keep their places ahead of the requests they were queued before.
        if self._by_priority:
            for request in skipped:
                self._insert(self.waiting, request, front=False)
        else:
            self.waiting[:0] = skipped

        out.scheduled = [s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode]
        out.num_batched_tokens = sum(s.num_budget_tokens for s in scheduled)
        out.block_copies += self.block_manager.pop_block_copies()
        if self.kv_loader is not None:
            out.kv_transfer = self.kv_loader.take_transfer(idle=not out.scheduled and not out.block_copies)
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[SequenceId, list[int]],
                           logprobs: dict[SequenceId, list[Logprob]] | None = None,
                           beam_candidates: Mapping[SequenceId, Candidates] | None = None,
                           prompt_logprobs: dict[SequenceId, PromptLogprobsChunk] | None = None, *,
                           grammar_ended: dict[SequenceId, FinishReason] | None = None,
                           pooled: Mapping[SequenceId, torch.Tensor] | None = None) -> list[EngineCoreOutput]:
        """Apply one executed step: advance progress, cache full blocks, append samples, finish and free.

        Returns one output per sequence with tokens to report (forked ones after the sequence they were forked
        from): every token at once, or, under a stream interval of N, the first at once, then groups of N, then
        the rest when the sequence finishes. Requests that hold their outputs (best_of, beam search) report
        their best sequences once, when they end. ``sampled`` must hold tokens for every sequence of
        ``ScheduledRequest.sample_seq_ids``, ``beam_candidates`` proposals for every beam that sampled.
        ``grammar_ended``: constrained sequences that end with this step's token, and why (their grammar is
        complete: EOS, even under ignore_eos; their matcher failed: ERROR). ``pooled``: the output rows of each
        pooling request of the step (which ends with it). ``ended`` lists every sequence that ended.
        """
        outputs: list[EngineCoreOutput] = []
        num_finished = len(self._finished_ids)
        beams: dict[str, list[Request]] = {}
        for s in out.scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                if request.num_pending and s.sample and request.status is not RequestStatus.FINISHED:
                    # Preempted while this step ran (async scheduling): its token stands, and is recomputed.
                    request.num_pending -= 1
                    self._append(request, sampled[request.seq_id], logprobs.get(request.seq_id) if logprobs else None)
                    if (report := delta_output(request, self.config.stream_interval)) is not None:
                        outputs.append(report)
                continue   # aborted after it was scheduled
            if request.pooling is not None:   # its one step computed the whole prompt: it ends with it
                outputs.append(self._finish_pooled(request, pooled))
                continue
            if s.num_spec_tokens:
                outputs += self._update_speculated(s, sampled, logprobs)
                continue
            end = s.start + s.num_new_tokens
            # (async scheduling: the next step may already have advanced it further)
            request.num_computed_tokens = max(request.num_computed_tokens, end)
            self.num_prompt_tokens += max(0, min(end, request.num_prompt_tokens) - s.start)
            self.block_manager.cache_blocks(request, end)
            if self.reclaim_window is not None:
                self.block_manager.release_outside_window(request, self.reclaim_window)
            if prompt_logprobs and (chunk := prompt_logprobs.get(request.seq_id)) is not None:
                request.add_prompt_logprobs(chunk)   # before a fork below copies them
            seq_ids = s.sample_seq_ids
            if not seq_ids:
                continue
            if request.beam is not None:
                beams.setdefault(request.request_id, []).append(request)
                continue
            missing = [seq_id for seq_id in seq_ids if not sampled.get(seq_id)]
            if missing:
                raise ValueError(f"no sampled token for {missing} (sampled: {sorted(sampled)})")
            seqs = [request]
            if len(seq_ids) > 1:
                # Fork before the first sequence appends, so each starts from its pre-sample state.
                seqs += [self.fork_request(request, seq_id.index) for seq_id in seq_ids[1:]]
                request.sampling_params = request.sampling_params.clone(n=1, best_of=None)
            aborted, request.aborted_before_fork = request.aborted_before_fork, set()
            if request.num_pending:
                request.num_pending -= 1   # now known
            for seq in seqs:
                if seq.index in aborted:
                    self._finish(seq, FinishReason.ABORT)
                else:
                    self._append(seq, sampled[seq.seq_id], logprobs.get(seq.seq_id) if logprobs else None,
                                 grammar_ended.get(seq.seq_id) if grammar_ended else None)
                if seq.holds_outputs:
                    outputs += best_of_outputs(seq) if seq.ends_request else []
                    continue
                report = delta_output(seq, self.config.stream_interval)
                if report is not None:
                    outputs.append(report)
        for group in beams.values():
            outputs += self.beam_groups.step(group, beam_candidates or {})
            self.num_generation_tokens += len(group)   # its live beams: each got a token
        self.ended = self._finished_ids[num_finished:]
        self.admission.observe_step(out, len(self.ended), batch_full=len(out.scheduled) >= self.config.max_num_seqs,
                                    busy=self.has_unfinished_requests())
        return outputs

    def _finish_pooled(self, request: Request, pooled: Mapping[SequenceId, torch.Tensor] | None) -> EngineCoreOutput:
        rows = pooled.get(request.seq_id) if pooled else None
        if rows is None:
            raise ValueError(f"no pooled output for {request.seq_id}")
        request.num_computed_tokens = request.num_prompt_tokens
        self.num_prompt_tokens += request.num_prompt_tokens
        request.first_token_time = time.monotonic()
        self._finish(request, FinishReason.STOP)
        return EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.STOP,
                                num_prompt_tokens=request.num_prompt_tokens, request_finished=True,
                                times=request.times(), pooled=rows)

    # ----- async scheduling ------------------------------------------------------------

    def advance(self, out: SchedulerOutput) -> None:
        """Async scheduling: ``out`` is running, and the next step is scheduled before its tokens are known. Each
        row's chunk counts as computed, and each sampling row (one sequence, one token: the caller runs only such
        steps ahead) holds one pending token that the next step may already compute (the runner feeds it from
        this step's output); ``update_from_output(out, ...)`` makes it known."""
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens = s.start + s.num_new_tokens
            if s.sample:
                request.num_pending += 1

    def _ends_by_length(self, request: Request) -> bool:
        """Whether the pending token ends ``request`` whatever it is (max_tokens, max_model_len, the cache)."""
        num_tokens = request.num_planned_tokens
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is not None and request.num_output_tokens + request.num_pending >= max_tokens)
                or num_tokens >= self.max_model_len or num_tokens > self.capacity_tokens)

    # ----- speculative decoding --------------------------------------------------------

    def _lookahead(self, request: Request, num_new: int, limit: int) -> int:
        """Lookahead slots of a running sequence this step, at most ``limit``: the proposed tokens it may verify
        (speculative decoding; ``limit`` also holds what the step's budget has room for after the decodes
        queued behind it), or its further decode passes (multi-step). None unless it decodes (one known token to
        compute), samples alone (not a beam search, not the fork of n > 1) and unconstrained (a grammar's masks
        and a thinking budget follow its tokens one by one); never past ``max_tokens`` or ``max_model_len`` (the
        step can emit one token more than it has lookahead slots)."""
        if num_new != 1 or request.num_tokens - request.num_computed_tokens != 1 or request.beam is not None:
            return 0
        params = request.sampling_params
        if params.follows_each_token or params.num_forked > 1:
            return 0
        k = min(limit, self.max_model_len - request.num_tokens - 1,
                self.capacity_tokens - request.num_tokens - 1)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - request.num_output_tokens - 1)
        return max(0, k)

    def _update_speculated(self, s: ScheduledRequest, sampled: dict[SequenceId, list[int]],
                           logprobs: dict[SequenceId, list[Logprob]] | None) -> list[EngineCoreOutput]:
        """A decode that verified proposed tokens: ``sampled`` holds those accepted and the target's token after
        them. Its computed tokens advance past the accepted ones only (their KV was written with the tokens they
        turned out to be); the lookahead slots past its tokens go back to the pool."""
        request = s.request
        tokens = sampled.get(request.seq_id)
        if not tokens or len(tokens) > 1 + s.num_spec_tokens:
            raise ValueError(f"{request.seq_id}: {0 if not tokens else len(tokens)} tokens for a row verifying at "
                             f"most {s.num_spec_tokens} proposed ones")
        # A prompt's last token computed alone (its last chunk) is a prompt token, proposals or not.
        self.num_prompt_tokens += max(0, min(s.start + 1, request.num_prompt_tokens) - s.start)
        self._append(request, tokens, logprobs.get(request.seq_id) if logprobs else None)
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens = s.start + len(tokens)
            self.block_manager.cache_blocks(request, request.num_computed_tokens)
            self.block_manager.trim(request, request.num_tokens)
        if request.holds_outputs:
            return best_of_outputs(request) if request.ends_request else []
        report = delta_output(request, self.config.stream_interval)
        return [] if report is None else [report]

    # ----- multi-step decode -----------------------------------------------------------

    def lookahead_pass(self, first: SchedulerOutput, j: int) -> SchedulerOutput | None:
        """Pass ``j`` (>= 1) of a multi-step step whose first pass was ``first``: its rows given at least ``j``
        further passes that still run (one that stopped is finished, its blocks freed), each decoding the token
        the pass before sampled, into a slot allocated with the first pass. None when no row is left. Applied
        with ``update_from_output`` like any step: stop checks, penalties and streaming see every pass."""
        rows = [ScheduledRequest.of(s.request, 1) for s in first.scheduled
                if s.num_lookahead_steps >= j and s.request.status is RequestStatus.RUNNING]
        if not rows:
            return None
        return SchedulerOutput(scheduled=rows, num_batched_tokens=len(rows), pass_index=j)

    # ----- helpers -------------------------------------------------------------------

    def _preempt_for(self, request: Request, scheduled: list[ScheduledRequest], out: SchedulerOutput) -> int | None:
        """Priority policy: preempt the worst running unit (a sequence, or every beam of a search) when the
        waiting ``request`` has a strictly better priority (a lower value; equal priorities never preempt each
        other). Returns the budget its chunks of this step gave back (0 when not scheduled yet), or None when
        nothing was preempted."""
        # (running is sorted best first: the worst is the last, or the last not protected from preemption)
        worst = self.preemption_guard.priority_victim(self.running, request.priority) if self._by_priority else None
        if worst is None:
            return None
        victims = [worst] if worst.beam is None else [s for s in worst.sequences
                                                      if s.status is RequestStatus.RUNNING]
        freed = 0
        for victim in victims:
            self.running.remove(victim)
            for i, s in enumerate(scheduled):
                if s.request is victim:
                    freed += scheduled.pop(i).num_budget_tokens
                    break
        # Their copy-on-write copies of this step go with them: the destinations are about to be freed.
        own = {b for victim in victims for b in victim.block_ids}
        # (an earlier victim's call may already have moved them to ``out``).
        out.block_copies = [c for c in out.block_copies + self.block_manager.pop_block_copies() if c[1] not in own]
        for victim in victims:
            self._preempt(victim)
            out.preempted.append(victim.seq_id)
        return freed

    def _running_loras(self) -> set[int] | None:
        """The adapters of the running sequences (the base model is none); None when LoRA is off."""
        if self._max_loras is None:
            return None
        return {r.lora_id for r in self.running if r.lora_id is not None}

    def _lora_fits(self, loras: set[int] | None, lora_id: int | None) -> bool:
        """Whether a sequence of adapter ``lora_id`` may join running ones that use ``loras``."""
        if loras is None or lora_id is None or lora_id in loras:
            return True
        return self._max_loras is not None and len(loras) < self._max_loras

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks and queue it first in line; its outputs stay and are recomputed."""
        self.block_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.reset_prompt_logprobs()   # recomputed from the prompt's start with the rest
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.preemption_guard.mark(victim)
        self._insert(self.waiting, victim, front=True)

    def _append(self, request: Request, tokens: list[int], lps: list[Logprob] | None,
                grammar_end: FinishReason | None = None) -> None:
        for j, token in enumerate(tokens):
            request.append_output_token(token)
            if lps is not None:   # the runner reports them for best_of even when the request asked for none
                request.output_logprobs.append(lps[j])
                request.cumulative_logprob += lps[j][0]
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
            self.admission.observe_first_token(request.first_token_time - request.arrival_time,
                                               request.expected_wait_s)

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
        elif self.kv_loader is None or not self.kv_loader.cancel(request):   # (not waiting while it loads)
            self.waiting.remove(request)
        if (reason is FinishReason.LENGTH and request.kv_handoff and self.kv_transfer is not None
                and request.num_tokens < self.max_model_len):   # its first token: the sequence goes on elsewhere
            request.kv_transfer_out = self.kv_transfer.hold(request)
        else:
            self.block_manager.free(request)
        request.num_pending = 0   # a step in flight may still sample for it: that token is dropped
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
