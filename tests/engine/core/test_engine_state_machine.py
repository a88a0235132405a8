"""Random interleavings of add / step / abort / fork under block pressure keep the block pool consistent, and the
running sequences within --max-loras adapters."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import EngineConfig, LoRAConfig
from engine.core.lora_request import LoRARequest
from engine.core.request import Request, RequestStatus, SequenceId
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput

EOS = 0
BLOCK_SIZE = 4
NUM_BLOCKS = 12          # 48 tokens of KV: preemption and the capacity limit both happen
MAX_MODEL_LEN = 64
BUDGET = 16
MAX_NUM_SEQS = 4
# Prompts start with one of a few shared prefixes so that prefix hits (and forged-looking near misses) happen.
PREFIXES = [[], [5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 9]]
# Three adapters (and the base model) over two LoRA slots: the same prefixes under different adapters never share.
MAX_LORAS = 2
LORAS = [None, *(LoRARequest(f"lora{i}", i, f"/adapters/{i}") for i in (1, 2, 3))]


class SchedulerMachine(RuleBasedStateMachine):
    policy = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.sched = Scheduler(self.config(), NUM_BLOCKS, eos_token_ids={EOS}, max_model_len=MAX_MODEL_LEN)
        self.next_id = 0
        self.finished: set[SequenceId] = set()    # sequences reported ended
        self.done: set[str] = set()              # requests the scheduler said ended (request_finished)

    def config(self) -> EngineConfig:
        return EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_NUM_SEQS,
                            scheduling_policy=self.policy, lora_config=LoRAConfig(max_loras=MAX_LORAS))

    # ----- rules ---------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 6), min_size=1, max_size=20),
          n=st.integers(1, 3), max_tokens=st.one_of(st.none(), st.integers(1, 30)),
          priority=st.integers(0, 2), ignore_eos=st.booleans(), lora=st.sampled_from(LORAS))
    def add(self, prefix: list[int], tail: list[int], n: int, max_tokens: int | None, priority: int,
            ignore_eos: bool, lora: LoRARequest | None) -> None:
        params = SamplingParams(n=n, seed=self.next_id, max_tokens=max_tokens, ignore_eos=ignore_eos)
        request = Request(f"r{self.next_id}", prefix + tail, params, priority=priority, lora_request=lora)
        self.next_id += 1
        self.sched.add_request(request)

    @rule(rng=st.randoms(use_true_random=False))
    def step(self, rng: random.Random) -> None:
        out = self.sched.schedule()
        self._check_output(out)
        self._apply(out, rng)

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data(), whole=st.booleans())
    def abort(self, data: st.DataObject, whole: bool) -> None:
        """Abort a live sequence, or the whole request it belongs to."""
        seq_id = data.draw(st.sampled_from(sorted(r.seq_id for r in self.sched.running + self.sched.waiting)))
        request = self.sched.requests[seq_id]
        aborted = self.sched.abort_request(seq_id.request_id, None if whole else seq_id.index)
        # Sequence 0 before the fork stands for all n: aborting one of them alone ends it at the fork.
        if whole or request.sampling_params.n == 1:
            assert seq_id in {r.seq_id for r in aborted}
        assert all(r.is_finished and r.block_ids == [] for r in aborted)
        assert [r.ends_request for r in aborted].count(True) <= 1
        self._ended(aborted)

    @rule(rng=st.randoms(use_true_random=False), data=st.data())
    def abort_mid_step(self, rng: random.Random, data: st.DataObject) -> None:
        """An abort that lands between schedule and update (the runner is busy)."""
        out = self.sched.schedule()
        self._check_output(out)
        if out.scheduled:
            victim = data.draw(st.sampled_from([s.request.seq_id for s in out.scheduled]))
            whole = data.draw(st.booleans())
            self._ended(self.sched.abort_request(victim.request_id, None if whole else victim.index))
        self._apply(out, rng)

    @rule()
    def drain(self) -> None:
        """Every request finishes in bounded steps: no livelock between preemptions."""
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            out = self.sched.schedule()
            self._check_output(out)
            self._apply(out, random.Random(len(self.finished)))
        assert not self.sched.has_unfinished_requests()
        assert self.sched.block_manager.num_free_blocks == NUM_BLOCKS
        # Every request added was said done exactly once, by the scheduler.
        assert self.done == {f"r{i}" for i in range(self.next_id)} and self.sched.requests == {}

    # ----- fake runner and checks ----------------------------------------------------

    def _ended(self, aborted: list[Request]) -> None:
        """Sequences aborted (their outputs are the caller's to report): the same checks as reported ones."""
        for r in aborted:
            self.finished.add(r.seq_id)
            if r.ends_request:
                self._request_done(r.request_id)

    def _request_done(self, request_id: str) -> None:
        assert request_id not in self.done, f"{request_id} said done twice"
        self.done.add(request_id)
        assert not any(seq_id.request_id == request_id for seq_id in self.sched.requests)

    def _samples(self, out: SchedulerOutput, rng: random.Random) -> dict[SequenceId, list[int]]:
        """What the fake runner returns: one random token (EOS now and then) per sampled sequence."""
        return {seq_id: [rng.randrange(0, 8)] for s in out.scheduled for seq_id in s.sample_seq_ids}

    def _apply(self, out: SchedulerOutput, rng: random.Random) -> None:
        sampled = self._samples(out, rng)
        for o in self.sched.update_from_output(out, sampled):
            assert o.seq_id not in self.finished, f"{o.seq_id} reported after it finished"
            assert o.request_id not in self.done, f"{o.request_id} reported after it was said done"
            if o.finished:
                self.finished.add(o.seq_id)
                r = self.sched.get_request(o.request_id, o.index)
                assert r is None or r.is_finished
            if o.request_finished:
                assert o.finished
                self._request_done(o.request_id)

    def _check_output(self, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens == sum(s.num_budget_tokens for s in out.scheduled) <= BUDGET
        ids = [s.request.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        decodes = [s.is_decode for s in out.scheduled]
        assert decodes == sorted(decodes, reverse=True), "decodes must come first"
        for s in out.scheduled:
            r = s.request
            assert r.status is RequestStatus.RUNNING and s.num_new_tokens >= 1
            assert s.start == r.num_computed_tokens and s.start + s.num_new_tokens <= r.num_tokens
            assert len(r.block_ids) * BLOCK_SIZE >= s.start + s.num_new_tokens
            assert s.sample == (s.start + s.num_new_tokens == r.num_tokens)
        for src, dst in out.block_copies:
            assert src != dst and 0 <= src < NUM_BLOCKS and 0 <= dst < NUM_BLOCKS
            assert any(dst in s.request.block_ids for s in out.scheduled)

    @invariant()
    def block_pool_is_consistent(self) -> None:
        sched = self.sched
        live = sched.running + sched.waiting
        sched.block_manager.check_invariants(live)
        assert {r.seq_id for r in live} == {seq_id for seq_id, r in sched.requests.items() if not r.is_finished}
        assert len(live) == len({r.seq_id for r in live})
        for seq_id, r in sched.requests.items():
            assert r.seq_id == seq_id and r.sequences[r.index] is r
            assert not all(s.is_finished for s in r.sequences), "an ended request is still kept"
            assert r.is_finished == (r.block_ids == [] and r.status is RequestStatus.FINISHED)
        for r in sched.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert len({r.lora_id for r in sched.running} - {None}) <= MAX_LORAS
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert r.num_computed_tokens < r.num_tokens <= MAX_MODEL_LEN
            assert len(r.block_ids) * BLOCK_SIZE >= r.num_computed_tokens

    def teardown(self) -> None:
        for seq_id in list(self.sched.requests):
            self.sched.abort_request(seq_id.request_id)
        assert not self.sched.has_unfinished_requests()
        assert self.sched.block_manager.num_free_blocks == NUM_BLOCKS
        self.sched.block_manager.check_invariants([])


class PrioritySchedulerMachine(SchedulerMachine):
    policy = "priority"


TestSchedulerFcfs = SchedulerMachine.TestCase
TestSchedulerPriority = PrioritySchedulerMachine.TestCase
_SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestSchedulerFcfs.settings = _SETTINGS
TestSchedulerPriority.settings = _SETTINGS
