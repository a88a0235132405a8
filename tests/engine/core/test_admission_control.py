"""engine.core.admission: the measured rates, the expected first-token wait and the refusal, on a controlled clock;
and the scheduler refusing through it (QueueFullError with a retry hint, nothing queued, counted)."""

from __future__ import annotations

import math

import pytest

from common.errors import QueueFullError
from engine.config import EngineConfig
from engine.core.admission import (
    ERROR_WINDOW,
    FIRST_TOKEN_WAIT,
    MIN_DEPARTURES,
    MIN_ERRORS,
    MIN_STEPS,
    QUEUE_FULL,
    AdmissionControl,
    DecayingRate,
    QueueState,
    StepCost,
    queue_state,
)
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput

EOS = 2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_request(request_id: str, num_prompt: int, **params: object) -> Request:
    params.setdefault("ignore_eos", True)
    params.setdefault("max_tokens", 4)
    return Request(request_id, [100 + i for i in range(num_prompt)], SamplingParams(**params))  # type: ignore[arg-type]


def step_output(prefill_tokens: int, num_decodes: int = 0) -> SchedulerOutput:
    """A step computing ``prefill_tokens`` of one prompt and ``num_decodes`` decodes."""
    rows = []
    if prefill_tokens:
        rows.append(ScheduledRequest.of(make_request("p", prefill_tokens + 10), prefill_tokens))
    for i in range(num_decodes):
        r = make_request(f"d{i}", 4)
        r.num_computed_tokens = 3
        rows.append(ScheduledRequest.of(r, 1))
    return SchedulerOutput(scheduled=rows)


def feed(adm: AdmissionControl, clock: Clock, steps: int, *, seconds: float, prefill: int = 0, decodes: int = 0,
         ended: int = 0, batch_full: bool = False) -> None:
    for _ in range(steps):
        clock.now += seconds
        adm.observe_step(step_output(prefill, decodes), ended, batch_full=batch_full, busy=True)


def test_a_decaying_rate_is_the_ratio_of_decayed_sums() -> None:
    rate = DecayingRate(horizon_s=1.0)
    assert rate.rate is None
    rate.add(100, 0.5)
    assert rate.rate == pytest.approx(200)
    rate.add(0, 1.0)   # one horizon later: the first measurement weighs 1/e
    keep = math.exp(-1.0)
    assert rate.rate == pytest.approx(100 * keep / (0.5 * keep + 1.0))
    assert rate.total == 100 and rate.samples == 2


def test_the_queue_state_counts_uncomputed_prompts_and_the_seats_short() -> None:
    waiting = [make_request("w0", 30), make_request("w1", 50)]
    prefilling, decoding = make_request("r0", 100), make_request("r1", 8)
    prefilling.num_computed_tokens = 40
    decoding.num_computed_tokens = 7   # one token left: a decode, not prefill
    assert queue_state(waiting, [prefilling, decoding], free_seats=1) == QueueState(30 + 50 + 60, 2)
    assert queue_state([], [decoding], free_seats=1) == QueueState(0, 0)


def started(max_wait_ms: int | None, budget: int = 1000) -> tuple[AdmissionControl, Clock]:
    """An AdmissionControl whose clock has started (the first step only starts it)."""
    clock = Clock()
    adm = AdmissionControl(max_wait_ms, budget, clock=clock)
    adm.observe_step(step_output(0), 0, batch_full=False, busy=True)
    return adm, clock


def test_the_step_cost_is_a_least_squares_fit() -> None:
    cost = StepCost(horizon_s=1e9)   # (no decay: plain least squares)
    for tokens in (0, 0, 100, 300):
        cost.add(tokens, 0.05 + 0.001 * tokens)
    base, per_token = cost.fit()
    assert (base, per_token) == (pytest.approx(0.05), pytest.approx(0.001))
    assert cost.seconds(2500, 1000) == pytest.approx(3 * 0.05 + 2.5)
    same = StepCost()
    for _ in range(4):
        same.add(20, 0.2)   # every step alike: no per-token part shows, a step costs what they took
    assert same.fit() == (pytest.approx(0.2), 0.0)
    assert same.seconds(60, 1000) == pytest.approx(0.2)   # three such prompts fit one step


def test_nothing_is_refused_before_enough_measurements() -> None:
    adm, clock = started(10)
    busy = QueueState(prefill_tokens_ahead=10**6, seats_short=10**4)
    assert adm.expected_wait_s(100, busy) is None
    adm.check(100, [make_request(f"w{i}", 1000) for i in range(50)], [], 0)   # no measurement: admitted
    feed(adm, clock, MIN_STEPS - 1, seconds=0.1, prefill=100)
    assert adm.expected_wait_s(100, busy) is None
    feed(adm, clock, 1, seconds=0.1, prefill=100)
    assert adm.expected_wait_s(100, QueueState(10**6, 0)) == pytest.approx(1001 * 0.1)   # 1001 steps
    assert adm.departures.total == 0 < MIN_DEPARTURES   # seats not measured: that part is left out
    assert adm.expected_wait_s(100, busy) == pytest.approx(1001 * 0.1)


def test_the_expected_wait_from_the_step_cost_and_the_seat_rate() -> None:
    adm, clock = started(2000)
    # Decode steps of 0.05 s and steps with prefill costing 0.1 ms more per prompt token.
    for tokens in (0, 200, 0, 600, 0, 1000, 0, 400):
        feed(adm, clock, 1, seconds=0.05 + 0.0001 * tokens, prefill=tokens, decodes=3)
    # 10 steps of 0.05 s with the batch full, one sequence ending every other step: 10 sequences/s.
    for i in range(10):
        feed(adm, clock, 1, seconds=0.05, decodes=4, ended=i % 2, batch_full=True)
    base, per_token = adm.steps.fit()
    assert (base, per_token) == (pytest.approx(0.05), pytest.approx(0.0001))
    assert adm.departures.rate == pytest.approx(10, rel=0.02)   # (decay weighs the later steps a little more)
    # A free seat: 4000 tokens ahead and its 1000 take 5 steps (budget 1000): 5 x 0.05 + 5000 x 0.1 ms.
    assert adm.expected_wait_s(1000, QueueState(4000, 0)) == pytest.approx(0.75)
    # Five seats short: five endings at ~10/s, then its own prefill (0.15 s), more than the work ahead takes.
    wait = adm.expected_wait_s(1000, QueueState(100, 5))
    assert wait == pytest.approx(5 / adm.departures.rate + 0.15)


def test_a_request_over_the_bound_is_refused_with_a_retry_hint_and_counted() -> None:
    adm, clock = started(1000, budget=100)
    feed(adm, clock, MIN_STEPS, seconds=0.1, prefill=100)   # 0.1 s a step of 100 tokens
    adm.check(100, [make_request("w0", 800)], [], 1)   # 9 steps, 0.9 s: admitted
    waiting = [make_request(f"w{i}", 1000) for i in range(3)]   # 31 steps, 3.1 s
    with pytest.raises(QueueFullError, match="expected wait for a first token is 3100 ms") as err:
        adm.check(100, waiting, [], 10)
    assert err.value.retry_after_s == 3   # ceil(3.1 - 1.0)
    assert adm.refused == {QUEUE_FULL: 0, FIRST_TOKEN_WAIT: 1}
    # Nothing ahead (a free seat, nothing to prefill before it): admitted whatever its own prompt costs.
    decoding = make_request("d", 4)
    decoding.num_computed_tokens = 3
    adm.check(5000, [], [decoding], 1)
    with pytest.raises(QueueFullError):
        adm.check(5000, [], [decoding], 0)   # no seat: it waits for one, and its prefill after


def test_without_a_bound_it_measures_and_never_refuses() -> None:
    adm, clock = started(None, budget=100)
    feed(adm, clock, MIN_STEPS, seconds=0.1, prefill=100)
    assert adm.expected_wait_s(100, QueueState(10**6, 0)) is not None
    adm.check(100, [make_request(f"w{i}", 1000) for i in range(100)], [], 0)
    assert adm.refused[FIRST_TOKEN_WAIT] == 0


def test_idle_time_is_not_service_time() -> None:
    adm, clock = started(1000)
    feed(adm, clock, 4, seconds=0.1, prefill=100)
    clock.now += 0.1
    adm.observe_step(step_output(100), 0, batch_full=False, busy=False)   # the last request ended: it idles
    clock.now += 60
    adm.observe_step(step_output(100), 0, batch_full=False, busy=True)    # the idle minute is not counted
    feed(adm, clock, 4, seconds=0.1, prefill=100)
    assert adm.steps.samples == 9 and adm.steps.fit() == (pytest.approx(0.1), 0.0)


def test_the_scheduler_refuses_through_it_and_queues_nothing() -> None:
    """Seat-bound: max_num_seqs 2, every request 4 tokens of prompt and 4 of output; one step is 0.1 s."""
    clock = Clock()
    sched = Scheduler(EngineConfig(max_num_seqs=2, max_expected_ttft_ms=1500), 256, eos_token_ids={EOS},
                      max_model_len=4096)
    sched.admission.clock = clock
    n = 0

    def add() -> None:
        nonlocal n
        sched.add_request(make_request(f"r{n}", 4))
        n += 1

    def step() -> None:
        out = sched.schedule()
        clock.now += 0.1
        sched.update_from_output(out, {seq_id: [7] for s in out.scheduled for seq_id in s.sample_seq_ids})

    for _ in range(9):   # a steady backlog of two waiting: the batch stays full, a pair ends every 4 steps
        while sched.num_waiting < 2:
            add()
        step()
    assert (sched.num_running, sched.num_waiting) == (2, 0)
    rate = sched.admission.departures.rate
    assert rate == pytest.approx(5, rel=0.05)   # 2 every 0.4 s
    admitted = 0
    with pytest.raises(QueueFullError) as err:
        for _ in range(20):   # the k-th waits for k endings: k / rate seconds, admitted up to 1.5 s
            add()
            admitted += 1
    assert admitted == math.floor(1.5 * rate) == 7
    assert err.value.retry_after_s == 1
    assert sched.num_waiting == admitted and sched.admission.refused[FIRST_TOKEN_WAIT] == 1
    assert sched.get_request(f"r{n}") is None
    for _ in range(8):   # the backlog drains: admitted again
        step()
    add()
    while sched.has_unfinished_requests():
        step()
    for _ in range(MIN_STEPS):
        sched.admission.steps.add(0, 100.0)   # measured under a load now gone: 100 s a step
    add()   # an idle engine admits whatever it measured: nothing is ahead
    with pytest.raises(QueueFullError):
        add()   # (while one behind a prefill of 100 s is refused)


def test_the_flag_reaches_the_config_and_sluice_serves_engine_command_line() -> None:
    import argparse

    from engine.entrypoints.args import add_engine_args, config_from_args
    from services.child_flags import engine_flags

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args(["--max-expected-ttft-ms", "2500"]))
    assert config.max_expected_ttft_ms == 2500
    flags = engine_flags(config)
    assert flags[flags.index("--max-expected-ttft-ms") + 1] == "2500"
    assert config_from_args(parser.parse_args(flags)) == config
    assert config_from_args(parser.parse_args([])).max_expected_ttft_ms is None
    with pytest.raises(ValueError, match="max_expected_ttft_ms"):
        EngineConfig(max_expected_ttft_ms=0)


def test_the_estimate_is_held_to_the_bound_with_the_p99_of_its_measured_error() -> None:
    adm, clock = started(1000, budget=100)
    feed(adm, clock, MIN_STEPS, seconds=0.1, prefill=100)   # 0.1 s a step of 100 tokens
    ahead = [make_request("w0", 700)]   # 8 steps with its own 100 tokens: 0.8 s expected
    assert adm.check(100, ahead, [], 1) == pytest.approx(0.8)
    for _ in range(MIN_ERRORS - 1):   # not enough errors yet: the margin stays 1
        adm.observe_first_token(1.2, 0.8)
    assert adm.margin == 1.0
    adm.observe_first_token(1.2, 0.8)
    assert adm.margin == pytest.approx(1.5)   # first tokens came 1.5 x later than expected
    with pytest.raises(QueueFullError, match=r"x 1.50") as e:
        adm.check(100, ahead, [], 1)   # 0.8 s x 1.5 > 1 s: refused now
    assert e.value.retry_after_s == 1
    assert adm.check(100, [make_request("w0", 500)], [], 1) == pytest.approx(0.6)   # 0.9 s: admitted
    # Estimates that were right push the old errors out of the window; early ones never lower it below 1.
    for _ in range(ERROR_WINDOW):
        adm.observe_first_token(0.4, 0.8)
    assert adm.margin == 1.0
    # The p99, not the worst: one outlier in a hundred does not set it.
    for i in range(100):
        adm.observe_first_token(8.0 if i == 0 else 0.88, 0.8)
    assert adm.margin == pytest.approx(1.1)


def test_small_estimates_and_requests_without_one_do_not_move_the_margin() -> None:
    adm, _ = started(1000)
    for _ in range(2 * MIN_ERRORS):
        adm.observe_first_token(1.0, 0.05)   # under a tenth of the bound: noise
        adm.observe_first_token(5.0, None)   # admitted with nothing ahead of it
    assert adm.margin == 1.0
    unbounded = AdmissionControl(None, 100)
    for _ in range(2 * MIN_ERRORS):
        unbounded.observe_first_token(5.0, 1.0)
    assert unbounded.margin == 1.0 and unbounded.check(1, [], [], 0) is None
