"""The scheduler state machine (test_engine_state_machine) driven through async scheduling: ``AsyncSteps`` with a
fake runner on its worker thread, so each step is scheduled while the one before it is in flight. Random adds,
steps, aborts (now always while a step runs) and drains under block pressure keep the block pool consistent, end
every request exactly once, and never schedule past a pending token's limits."""
from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from engine.core.async_steps import AsyncSteps
from engine.core.outputs import EngineCoreOutput
from engine.core.request import RequestStatus
from engine.core.scheduler_output import SchedulerOutput
from engine.worker.model_runner import RunnerOutput
from tests.engine.core.test_engine_state_machine import BLOCK_SIZE, BUDGET, MAX_MODEL_LEN, NUM_BLOCKS, SchedulerMachine


class FakeExecutor:
    """Prepares nothing; its "forward pass" (on AsyncSteps' worker thread) samples a random token (EOS now and
    then) for every sequence a step samples, from a generator seeded by the step's number."""

    def __init__(self) -> None:
        self.steps = 0

    def prepare_model(self, sched: SchedulerOutput) -> tuple[SchedulerOutput, int]:
        self.steps += 1
        return sched, self.steps

    def execute_prepared(self, prepared: tuple[SchedulerOutput, int]) -> RunnerOutput:
        sched, number = prepared
        rng = random.Random(number)
        return RunnerOutput(sampled={seq_id: [rng.randrange(0, 8)] for s in sched.scheduled
                                     for seq_id in s.sample_seq_ids})


class AsyncSchedulerMachine(SchedulerMachine):
    total_ran_ahead = 0   # steps left running ahead, over all examples
    def __init__(self) -> None:
        super().__init__()
        # LoRA adapters make every step synchronous (is_plain): this machine's steps run ahead without them.
        config = replace(self.sched.config, lora_config=None)
        self.sched.config = config
        self.sched._max_loras = None
        self.steps = AsyncSteps(self.sched, FakeExecutor(), config, self._apply_result)  # type: ignore[arg-type]
        self.ran_ahead = 0
        schedule = self.sched.schedule

        def checked_schedule() -> SchedulerOutput:
            out = schedule()
            for s in out.scheduled:   # a sequence scheduled on top of a pending token can take one more
                r = s.request
                if r.num_pending:
                    assert r.num_planned_tokens < MAX_MODEL_LEN
                    assert r.sampling_params.max_tokens is None or (
                        r.num_output_tokens + r.num_pending < r.sampling_params.max_tokens)
            return out

        self.sched.schedule = checked_schedule  # type: ignore[method-assign]

    def _apply_result(self, out: SchedulerOutput, run: RunnerOutput | None) -> list[EngineCoreOutput]:
        self._report(self.sched.update_from_output(out, run.sampled if run is not None else {}))
        return []

    def _report(self, outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            assert o.seq_id not in self.finished, f"{o.seq_id} reported after it finished"
            assert o.request_id not in self.done, f"{o.request_id} reported after it was said done"
            if o.finished:
                self.finished.add(o.seq_id)
            if o.request_finished:
                assert o.finished
                self._request_done(o.request_id)

    def _one_step(self) -> None:
        self.steps.step()
        if self.steps.busy:
            self.ran_ahead += 1
            self._check_in_flight(self.steps._inflight.sched)  # type: ignore[union-attr]

    def _check_in_flight(self, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens == sum(s.num_budget_tokens for s in out.scheduled) <= BUDGET
        for s in out.scheduled:
            r = s.request
            if r.status is not RequestStatus.RUNNING:
                continue   # ended by the step applied after it was scheduled: its row's result is dropped
            assert s.start + s.num_new_tokens == r.num_computed_tokens <= r.num_planned_tokens <= MAX_MODEL_LEN
            assert len(r.block_ids) * BLOCK_SIZE >= s.start + s.num_new_tokens
            params = r.sampling_params
            if s.sample and params.max_tokens is not None:
                assert r.num_output_tokens + r.num_pending <= params.max_tokens

    @rule(rng=st.randoms(use_true_random=False))
    def step(self, rng: random.Random) -> None:
        self._one_step()

    @rule(rng=st.randoms(use_true_random=False), data=st.data())
    def abort_mid_step(self, rng: random.Random, data: st.DataObject) -> None:
        """Under async scheduling every abort lands while a step runs: abort, then step."""
        live = sorted(r.seq_id for r in self.sched.running + self.sched.waiting)
        if live:
            victim = data.draw(st.sampled_from(live))
            whole = data.draw(st.booleans())
            self._ended(self.sched.abort_request(victim.request_id, None if whole else victim.index))
        self._one_step()

    @rule()
    def drain(self) -> None:
        for _ in range(2000):
            if not (self.sched.has_unfinished_requests() or self.steps.busy):
                break
            self._one_step()
        assert not self.sched.has_unfinished_requests() and not self.steps.busy
        assert self.sched.block_manager.num_free_blocks == NUM_BLOCKS
        assert self.done == {f"r{i}" for i in range(self.next_id)} and self.sched.requests == {}

    @invariant()
    def block_pool_is_consistent(self) -> None:
        sched = self.sched
        live = sched.running + sched.waiting
        sched.block_manager.check_invariants(live)
        for r in sched.waiting:   # a preempted sequence's pending token is known by the end of the step
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.num_pending == 0
        for r in sched.running:
            assert r.num_pending in (0, 1)
            assert r.num_computed_tokens <= r.num_planned_tokens <= MAX_MODEL_LEN

    def teardown(self) -> None:
        AsyncSchedulerMachine.total_ran_ahead += self.ran_ahead
        self.steps.close()
        super().teardown()


TestAsyncScheduler = AsyncSchedulerMachine.TestCase
TestAsyncScheduler.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


def test_steps_really_ran_ahead() -> None:
    """The machine above exercised steps in flight, not only synchronous fallbacks (it runs first: same module)."""
    assert AsyncSchedulerMachine.total_ran_ahead > 50
