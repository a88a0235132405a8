"""Async scheduling (vLLM's ``--async-scheduling``): step N + 1 is scheduled and its inputs prepared while step N
runs on the device (on CPU: on a worker thread, the forward pass releasing the GIL).

A step may run ahead of the one before it only when that one is *plain*: each sampling row samples one token for
one sequence, and nothing that row needs next (penalties, min_tokens, a grammar or a thinking budget, beams, best_of,
speculation, multi-step passes, LoRA adapters) depends on the token it is about to get. The scheduler then counts
that token as pending (``Scheduler.advance``): the next step schedules the sequence's decode as usual, and the runner
feeds the id from the previous step's output on the device. Anything else runs as before: scheduled after the step
before it has been applied. Outputs are the same either way; a sequence that ends with the pending token (EOS, a stop
token) wastes one row of the step ahead, whose result is dropped.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.outputs import EngineCoreOutput
from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.executor.base import Executor
    from engine.worker.model_runner import RunnerOutput

# Applies a step's result to the scheduler (None: nothing ran) and returns its outputs.
Apply = Callable[[SchedulerOutput, "RunnerOutput | None"], list[EngineCoreOutput]]


def is_plain(sched: SchedulerOutput, config: EngineConfig) -> bool:
    """Whether the step after ``sched`` may be scheduled before ``sched``'s tokens are known (see the module)."""
    if config.speculative_config is not None or config.lora_config is not None:
        return False
    for s in sched.scheduled:
        request = s.request
        params = request.sampling_params
        if (s.num_spec_tokens or s.num_lookahead_steps or s.num_beam_candidates or s.num_samples != 1
                or request.holds_outputs
                or request.beam is not None or params.follows_each_token):
            return False
        if s.sample and (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                         or params.presence_penalty != 0.0 or request.num_output_tokens < params.min_tokens):
            return False
    return True


@dataclass
class _InFlight:
    sched: SchedulerOutput
    future: Future[RunnerOutput]
    plain: bool


@dataclass
class AsyncStepStats:
    """What the last ``AsyncSteps.step`` call spent on the host while a step ran on the device."""

    schedule_s: float = 0.0   # scheduling the step ahead
    prepare_s: float = 0.0    # preparing its inputs
    wait_s: float = 0.0       # waiting for the running step's result
    update_s: float = 0.0     # applying it


class AsyncSteps:
    """The core's step loop with one step in flight on a worker thread. ``step`` returns the outputs of the step
    that was running when it was called, leaving the next one (when plain) running."""

    def __init__(self, scheduler: Scheduler, executor: Executor, config: EngineConfig, apply: Apply) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.config = config
        self.apply = apply
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sluice-step")
        self._inflight: _InFlight | None = None
        self.stats = AsyncStepStats()
        self.last_sched: SchedulerOutput | None = None   # the step whose outputs the last call returned

    @property
    def busy(self) -> bool:
        return self._inflight is not None

    def _launch(self, sched: SchedulerOutput) -> _InFlight:
        plain = is_plain(sched, self.config)
        prepared = self.executor.prepare_model(sched)
        if plain:
            self.scheduler.advance(sched)
        return _InFlight(sched, self._thread.submit(self.executor.execute_prepared, prepared), plain)

    def step(self) -> list[EngineCoreOutput]:
        stats = self.stats = AsyncStepStats()
        cur, self._inflight = self._inflight, None
        if cur is None:
            if not self.scheduler.has_unfinished_requests():
                return []
            sched = self.scheduler.schedule()
            self.last_sched = sched
            if not (sched.scheduled or sched.block_copies):
                return self.apply(sched, None)
            cur = self._launch(sched)
        # While it runs: the next step's schedule and inputs.
        ahead: _InFlight | None = None
        deferred: SchedulerOutput | None = None
        if cur.plain and self.scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            nxt = self.scheduler.schedule()
            t1 = time.perf_counter()
            stats.schedule_s = t1 - t0
            if is_plain(nxt, self.config) and (nxt.scheduled or nxt.block_copies):
                ahead = self._launch(nxt)
                stats.prepare_s = time.perf_counter() - t1
            else:
                deferred = nxt   # applied after this step: its inputs may need this step's tokens on the host
        t2 = time.perf_counter()
        try:
            run = cur.future.result()
        except BaseException:
            if ahead is not None:   # it ran after the failed step: its result means nothing
                ahead.future.exception()
            raise
        t3 = time.perf_counter()
        stats.wait_s = t3 - t2
        self.last_sched = cur.sched
        outputs = self.apply(cur.sched, run)
        if deferred is not None:
            outputs += self._run_deferred(deferred)
        stats.update_s = time.perf_counter() - t3
        self._inflight = ahead
        return outputs

    def _run_deferred(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """A step scheduled while the one before ran, that could not run ahead of it: run it now, without the
        rows of sequences that step ended (their blocks are free)."""
        sched.scheduled = [s for s in sched.scheduled if s.request.status is RequestStatus.RUNNING]
        if not (sched.scheduled or sched.block_copies):
            return self.apply(sched, None)
        return self.apply(sched, self._launch(sched).future.result())

    def drain(self) -> list[EngineCoreOutput]:
        """Finish the step in flight, if any; its outputs."""
        if self._inflight is None:
            return []
        cur, self._inflight = self._inflight, None
        return self.apply(cur.sched, cur.future.result())

    def close(self) -> None:
        if self._inflight is not None:
            self._inflight.future.exception()
            self._inflight = None
        self._thread.shutdown(wait=True)
