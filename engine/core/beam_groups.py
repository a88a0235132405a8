"""Scheduling units, and the scheduler's side of beam search.

A unit is a request's sequence, or every live beam of a beam search: scheduled
and preempted as one. A search's beams are scheduled together or not at all (a
beam's recomputed prefill stops one token short until all of them can sample in
the same step), and rewritten after each step: a beam chosen several times is
copied (blocks shared, copy-on-write), one not chosen is overwritten. The n best
hypotheses are reported when the search ends. ``engine.core.beam`` decides which
beams continue; the scheduler owns the queues, so forking and finishing go
through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from engine.core.beam import BeamSearchState, Candidates, Continuation
from engine.core.block_manager import BlockManager
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.reports import beam_outputs
from engine.core.request import Request, SequenceId


class BeamGroups:
    """Plans and admits scheduling units; steps and ends the beam searches among them."""

    def __init__(self, block_manager: BlockManager, *, eos_token_ids: frozenset[int], max_model_len: int,
                 fork: Callable[[Request, int], Request], finish: Callable[[Request, FinishReason], None]) -> None:
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._fork = fork       # the scheduler's fork_request: a running copy, queued
        self._finish = finish   # the scheduler's: end one sequence, free its blocks, unqueue it

    def new_search(self, request: Request) -> BeamSearchState:
        """The search state of a new beam-search request."""
        params = request.sampling_params
        assert params.beam_search is not None
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        return BeamSearchState(params.beam_search, num_stop_tokens=len(stops),
                               max_new_tokens=params.max_tokens or self.max_model_len - request.num_prompt_tokens)

    @staticmethod
    def units(queue: list[Request]) -> list[list[Request]]:
        """The queue's scheduling units in queue order: a sequence alone, or every live beam of a beam search
        (once, where its first beam stands)."""
        units: list[list[Request]] = []
        seen: set[str] = set()
        for request in queue:
            if request.beam is None:
                units.append([request])
            elif request.request_id not in seen:
                seen.add(request.request_id)
                units.append([s for s in request.sequences if not s.is_finished])
        return units

    @staticmethod
    def plan(unit: list[Request], budget: int, num_pending_decodes: int) -> list[tuple[Request, int]]:
        """(sequence, tokens to compute) of a running unit this step; prefill chunks leave one token of
        ``budget`` for each of the ``num_pending_decodes`` queued behind it."""
        remaining = [r.num_planned_tokens - r.num_computed_tokens for r in unit]
        if all(n == 1 for n in remaining):   # the beams of a search sample together, or wait
            return [(r, 1) for r in unit] if len(unit) == 1 or budget >= len(unit) else []
        if len(unit) == 1:
            num_new = min(remaining[0], budget - num_pending_decodes)
            return [(unit[0], num_new)] if num_new > 0 else []
        # Recomputed beams stop one token short, so that all of them reach their last token together.
        plan: list[tuple[Request, int]] = []
        budget -= num_pending_decodes
        for request, n in zip(unit, remaining):
            num_new = min(n - 1, budget)
            if num_new > 0:
                plan.append((request, num_new))
                budget -= num_new
        return plan

    def admit(self, unit: list[Request], budget: int) -> list[tuple[Request, int, int]] | None:
        """Give a waiting unit its blocks, all or none: (sequence, tokens to compute, cached tokens) of each,
        or None (nothing claimed) when the blocks are short."""
        admitted: list[tuple[Request, int, int]] = []
        for request in unit:
            # A request still owing prompt logprobs computes every prompt position: no cached blocks (as vLLM v1).
            computed = [] if request.needs_prompt_logprobs else self.block_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.block_manager.block_size
            short = 1 if len(unit) > 1 else 0   # beams stop one token short (see plan)
            num_new = max(0, min(request.num_tokens - num_cached - short, budget))
            if not self.block_manager.allocate(request, num_new, computed):
                for done, _, _ in admitted:
                    self.block_manager.free(done)
                return None
            admitted.append((request, num_new, num_cached))
            budget -= num_new
        return admitted

    def step(self, beams: list[Request], candidates: Mapping[SequenceId, Candidates]) -> list[EngineCoreOutput]:
        """One step of a beam search whose beams all sampled: rewrite them, or end the search and report.
        ``beams`` becomes the search's live beams (none once it has ended)."""
        beams.sort(key=lambda b: b.index)
        live = [s for s in beams[0].sequences if not s.is_finished]
        if len(live) != len(beams) or any(b.seq_id not in candidates for b in beams):
            raise ValueError(f"beams {[b.seq_id for b in beams]} of {len(live)} sampled without all proposals")
        state = beams[0].beam
        assert state is not None
        params = beams[0].sampling_params
        num_output = beams[0].num_output_tokens + 1   # after this step's token

        def stop_reason(token: int) -> FinishReason | None:
            if num_output < params.min_tokens:
                return None
            if token in params.stop_token_ids:
                return FinishReason.STOP
            return FinishReason.EOS if not params.ignore_eos and token in self.eos_token_ids else None

        continuations = state.step([(b.output_token_ids, b.cumulative_logprob) for b in beams],
                                   [candidates[b.seq_id] for b in beams], stop_reason,
                                   self._at_length_limit(beams[0], state.width))
        if state.done:
            for beam in beams:
                self._finish(beam, FinishReason.LENGTH)
            outputs = beam_outputs(beams[0], state.best(beams[0].num_returned))
            beams.clear()
            return outputs
        # The first step forks the other beams (sharing the prompt's blocks); a shorter step ends the extra.
        first_step = len(beams) == 1
        while len(beams) < len(continuations):
            beams.append(self._fork(beams[0], max(s.index for s in beams[0].sequences) + 1))
        for extra in beams[len(continuations):]:
            self._finish(extra, FinishReason.LENGTH)
        del beams[len(continuations):]
        if first_step:   # every beam is a copy of the one they all extend: each continues itself
            continuations = [Continuation(j, c.token_id, c.cumulative_logprob) for j, c in enumerate(continuations)]
        rewrite_beams(self.block_manager, beams, continuations)
        for beam in beams:
            if beam.first_token_time is None:
                beam.first_token_time = time.monotonic()
        return []

    def _at_length_limit(self, beam: Request, width: int) -> bool:
        """The next token ends every beam: max_tokens, max_model_len, or a group too big to recompute alone."""
        params = beam.sampling_params
        num_tokens = beam.num_tokens + 1
        bs = self.block_manager.block_size
        return ((params.max_tokens is not None and beam.num_output_tokens + 1 >= params.max_tokens)
                or num_tokens >= self.max_model_len
                or width * -(-num_tokens // bs) > self.block_manager.num_blocks)


def rewrite_beams(block_manager: BlockManager, beams: Sequence[Request], continuations: Sequence[Continuation]
                  ) -> None:
    """Make ``beams[j]`` its continuation ``j``: its parent's tokens and blocks plus the new token.

    Every parent is copied (its blocks shared, copy-on-write) before any beam is overwritten, so a beam
    may take the state of one that is itself being overwritten. A beam that continues itself keeps its
    blocks; one not chosen loses its own. ``len(beams) == len(continuations)``.
    """
    copies: dict[int, Request] = {}
    for j, c in enumerate(continuations):
        if c.parent != j:
            parent = beams[c.parent]
            holder = Request(parent.request_id, parent.prompt_token_ids, parent.sampling_params, index=parent.index,
                             lora_request=parent.lora_request, cache_salt=parent.cache_salt)
            block_manager.fork(parent, holder)
            holder.copy_tokens_from(parent)
            holder.num_computed_tokens = parent.num_computed_tokens
            copies[j] = holder
    for j, holder in copies.items():
        beam = beams[j]
        block_manager.free(beam)
        # The holder's block table moves to the beam as it is: the references it took are the beam's now.
        beam.block_ids, beam.block_hashes, beam.num_seen_blocks = (holder.block_ids, holder.block_hashes,
                                                                   holder.num_seen_blocks)
        beam.copy_tokens_from(holder)
        beam.num_computed_tokens = holder.num_computed_tokens
    for beam, c in zip(beams, continuations, strict=True):
        beam.append_output_token(c.token_id)
        beam.cumulative_logprob = c.cumulative_logprob
