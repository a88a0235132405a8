"""Speculative decoding (n-gram) under random interleavings of add / step / abort / fork / drain with block
pressure: a fake runner accepts a random number of each decode's proposed tokens, and after every rule the
block pool is consistent, the rejected lookahead slots went back to it, no sequence outgrew max_tokens or
max_model_len, and no step overspent its token budget."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis.stateful import invariant

from engine.config import EngineConfig, LoRAConfig, SpeculativeConfig
from engine.core.request import Request, RequestStatus, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from tests.engine.core.test_engine_state_machine import (
    BLOCK_SIZE,
    BUDGET,
    EOS,
    MAX_LORAS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    SchedulerMachine,
)

K = 3   # num_speculative_tokens


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


class SpecDecodeMachine(SchedulerMachine):
    """The scheduler machine with lookahead: a row with ``num_spec_tokens`` gets 1 to 1 + num_spec_tokens
    random tokens back (the accepted proposals and the token after them)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[SequenceId, Request] = {}   # every sequence scheduled, ended ones included
        self.sampled: dict[SequenceId, list[int]] = {}

    def config(self) -> EngineConfig:
        return EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_NUM_SEQS,
                            scheduling_policy=self.policy, lora_config=LoRAConfig(max_loras=MAX_LORAS),
                            speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=K))

    def _samples(self, out: SchedulerOutput, rng: random.Random) -> dict[SequenceId, list[int]]:
        self.sampled = {seq_id: [rng.randrange(0, 8) for _ in range(rng.randint(1, 1 + s.num_spec_tokens))]
                        for s in out.scheduled for seq_id in s.sample_seq_ids}
        return self.sampled

    def _apply(self, out: SchedulerOutput, rng: random.Random) -> None:
        before = {s.request.seq_id: s.request.num_output_tokens for s in out.scheduled}
        self.seen.update((s.request.seq_id, s.request) for s in out.scheduled)
        super()._apply(out, rng)
        for s in out.scheduled:
            if not s.num_spec_tokens:
                continue
            r = s.request
            sent = self.sampled[r.seq_id]
            new = r.output_token_ids[before[r.seq_id]:]
            # Appended in order up to the first stop (aborted mid-step: none).
            assert new == sent[:len(new)] and (len(new) == len(sent) or r.is_finished)
            if r.status is RequestStatus.RUNNING:
                # Computed past the accepted proposals only; the slots past its tokens went back to the pool
                # (all accepted: the token after them may need a block the step did not allocate).
                assert r.num_computed_tokens == r.num_tokens - 1 == s.start + len(sent)
                assert len(r.block_ids) == min(blocks_for(s.start + 1 + s.num_spec_tokens),
                                               blocks_for(r.num_tokens))

    def _check_output(self, out: SchedulerOutput) -> None:
        super()._check_output(out)
        for s in out.scheduled:
            if not s.num_spec_tokens:
                continue
            r = s.request
            params = r.sampling_params
            # Only a lone, unconstrained decode speculates, never past the limits the step could reach.
            assert s.is_decode and s.num_samples == 1 and r.beam is None and params.num_forked == 1
            assert s.num_spec_tokens <= K
            assert r.num_tokens + s.num_spec_tokens < MAX_MODEL_LEN
            assert params.max_tokens is None or r.num_output_tokens + s.num_spec_tokens < params.max_tokens
            assert len(r.block_ids) * BLOCK_SIZE >= s.start + 1 + s.num_spec_tokens

    @invariant()
    def lookahead_is_given_back_and_limits_hold(self) -> None:
        for r in self.sched.running:
            assert len(r.block_ids) <= blocks_for(r.num_tokens), f"{r.seq_id} kept lookahead blocks"
        for r in self.seen.values():
            limit = r.sampling_params.max_tokens
            assert limit is None or r.num_output_tokens <= limit, f"{r.seq_id} overshot max_tokens"
            assert r.num_tokens <= MAX_MODEL_LEN


class PrioritySpecDecodeMachine(SpecDecodeMachine):
    policy = "priority"


TestSpecDecodeFcfs = SpecDecodeMachine.TestCase
TestSpecDecodePriority = PrioritySpecDecodeMachine.TestCase
_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSpecDecodeFcfs.settings = _SETTINGS
TestSpecDecodePriority.settings = _SETTINGS


# ----- the lookahead in plain steps ------------------------------------------------------------------

def _scheduler(num_blocks: int = 16, budget: int = 32) -> Scheduler:
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
                          speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=K))
    return Scheduler(config, num_blocks, eos_token_ids={EOS}, max_model_len=MAX_MODEL_LEN)


def _step(sched: Scheduler, tokens: list[int]) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, {seq_id: tokens for s in out.scheduled for seq_id in s.sample_seq_ids})
    return out


def test_a_decode_verifies_k_proposed_tokens_and_gives_back_the_rejected_slots() -> None:
    sched = _scheduler()
    r = Request("r", [5, 6, 7, 8], SamplingParams(max_tokens=20))
    sched.add_request(r)
    _step(sched, [9])
    assert (r.num_tokens, r.num_computed_tokens, len(r.block_ids)) == (5, 4, 1)
    out = sched.schedule()
    [row] = out.scheduled
    assert (row.num_new_tokens, row.num_spec_tokens, out.num_batched_tokens) == (1, K, 1 + K)
    assert len(r.block_ids) == 2                      # slots 4..7: its token and K proposed ones
    sched.update_from_output(out, {r.seq_id: [10, 11, 12, 13]})   # all K accepted, and the token after them
    assert (r.num_tokens, r.num_computed_tokens, len(r.block_ids)) == (9, 8, 2)   # slot 8 comes next step
    _step(sched, [14])                                 # slots 8..11, all rejected: block 2 still holds slot 9
    assert (r.num_tokens, r.num_computed_tokens, len(r.block_ids)) == (10, 9, 3)
    out = sched.schedule()
    assert out.scheduled[0].num_spec_tokens == K and len(r.block_ids) == 4   # slots 9..12
    sched.update_from_output(out, {r.seq_id: [15]})    # all rejected: slot 12's block goes back
    assert (r.num_tokens, r.num_computed_tokens, len(r.block_ids)) == (11, 10, 3)
    assert sched.block_manager.num_free_blocks == 16 - 3
    sched.block_manager.check_invariants([r])


def test_lookahead_stops_one_short_of_max_tokens() -> None:
    sched = _scheduler()
    r = Request("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(r)
    _step(sched, [9])
    assert sched.schedule().scheduled[0].num_spec_tokens == 1   # 1 output, max 3: one proposal and the token after


def test_speculation_gives_way_before_anyone_is_preempted() -> None:
    # Two decodes in 2 blocks of 4: lookahead would need a third block, so neither speculates and none is preempted.
    sched = _scheduler(num_blocks=2)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, [5, 6, 7], SamplingParams(max_tokens=20)))
    _step(sched, [9])
    out = sched.schedule()
    assert [s.num_spec_tokens for s in out.scheduled] == [0, 0] and out.preempted == []


def test_a_prompt_whose_last_token_is_verified_with_proposals_counts_as_prompt_tokens() -> None:
    # A 17-token prompt under a budget of 16: its last chunk is one token, scheduled like a decode, with lookahead.
    sched = _scheduler(budget=16)
    r = Request("r", list(range(1, 18)), SamplingParams(max_tokens=20))
    sched.add_request(r)
    _step(sched, [9])
    out = _step(sched, [9])
    assert out.scheduled[0].num_spec_tokens > 0
    assert sched.num_prompt_tokens == 17
