"""What the scheduler hands the runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.request import Request, SequenceId

if TYPE_CHECKING:
    from engine.worker.kv_transfer import KVTransfer


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute ``all_token_ids[start:start + num_new_tokens]``."""

    request: Request
    num_new_tokens: int
    start: int            # request.num_computed_tokens when scheduled
    sample: bool          # start + num_new_tokens == request.num_tokens: the runner samples for it
    # Tokens the runner samples for it: n (best_of) for a request with n > 1 sampling for the first time, else 1.
    num_samples: int = 1
    # Beam search: the runner returns this many (token, logprob) proposals of the beam instead of a sample.
    num_beam_candidates: int = 0
    # Set (to the request's prompt_logprobs k) when the runner computes the logprobs of the prompt tokens this
    # chunk's positions predict; None for every other chunk (no full-vocabulary logits for them).
    num_prompt_logprobs: int | None = None
    # Speculative decoding: a decode row may be followed by up to this many proposed tokens, whose slots the
    # scheduler allocated and whose budget it counted (lookahead). The runner proposes them, verifies them with
    # the row's token in one pass and samples one to ``num_spec_tokens + 1`` tokens for it (``sampled``).
    num_spec_tokens: int = 0
    # Multi-step decode: after this step's pass, the row runs up to this many further decode passes in the same
    # step, one token each (``Scheduler.lookahead_pass``); their slots were allocated with the row's, and they
    # take none of the step's token budget (each pass is its own forward pass of at most max_num_seqs rows).
    num_lookahead_steps: int = 0

    @classmethod
    def of(cls, request: Request, num_new: int) -> ScheduledRequest:
        """``request`` computing its next ``num_new`` tokens this step."""
        sample = request.num_computed_tokens + num_new == request.num_planned_tokens
        # n > 1 only until the fork: the forked sequences, and the first one after it, have n = 1.
        n = request.sampling_params.num_forked if sample else 1
        num_candidates = request.beam.num_candidates if sample and request.beam is not None else 0
        # Positions before the prompt's last one predict prompt tokens (its last predicts the first output).
        wants_prompt = request.needs_prompt_logprobs and request.num_computed_tokens < request.num_prompt_tokens - 1
        return cls(request, num_new, request.num_computed_tokens, sample, n, num_candidates,
                   request.sampling_params.prompt_logprobs if wants_prompt else None)

    @property
    def num_budget_tokens(self) -> int:
        """What the row takes of the step's token budget: its known tokens and its lookahead slots."""
        return self.num_new_tokens + self.num_spec_tokens

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
    # Blocks to copy between the device cache and a KV offload tier before the forward pass (engine.core.kv_offload);
    # None: no tier, or nothing to move and no load in flight.
    kv_transfer: KVTransfer | None = None
    # Multi-step decode: 0 for a step's first pass; j for its j-th further pass (decode rows only, whose inputs
    # are the previous pass's rows one position on: ``engine.worker.multi_step``).
    pass_index: int = 0

    @property
    def num_scheduled_tokens(self) -> dict[SequenceId, int]:
        return {s.request.seq_id: s.num_new_tokens for s in self.scheduled}
