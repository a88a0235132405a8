"""Bounded first-token wait under overload: admission from measured rates, and protection from repeated preemption.

**Admission** (``--max-expected-ttft-ms``). Without it, a server offered more than it can serve queues every
request and every TTFT grows without bound. With it, the scheduler refuses a new request early (QueueFullError:
RESOURCE_EXHAUSTED, HTTP 429 + ``Retry-After``) when the wait for its first token, estimated from what the engine
itself measured, exceeds the bound. The estimate has two parts, each from a rate measured over the last few
seconds of busy time (each measurement weighed by ``exp(-busy seconds since / RATE_HORIZON_S)``):

* **prefill work**: the prompt tokens still to compute ahead of it (waiting requests, preempted ones to
  recompute, running ones still in their prefill) plus its own, W tokens, take ``ceil(W / max_num_batched_tokens)``
  steps; a step costs ``base + per_token * its prefill tokens``, fitted by least squares to the measured steps
  (``StepCost``: the base is what a step of the current batch's decodes costs, and the per-token part shows once
  steps with different prefill sizes were seen; a token rate alone would take a step of two short prompts for
  twice one of one, where on most devices both cost about a decode step);
* **seats**: when the running batch (``max_num_seqs``) has no seat left for it after the requests waiting ahead,
  it waits for that many sequences to end: their number over the rate at which sequences ended while the batch
  was full (the service rate the batch gives when it is the bottleneck), then its own prefill.

The expected wait is the larger of the two (``expected_wait_s``). A part whose rate has too few measurements yet
(``MIN_STEPS``, ``MIN_DEPARTURES``) is left out, and with neither part measured every request is admitted: requests
are never refused on a guess. KV blocks are not modelled: a queue held back by blocks alone shows in the prefill
part only. A request with nothing ahead of it (a free seat, no prompt tokens to compute before its own) is admitted
whatever its own prefill costs: refusing it would not shorten its wait, and rates measured under a load now gone
must not keep an idle engine refusing. A refusal's retry hint is the expected wait beyond the bound (whole seconds,
1 to 60): by then the backlog ahead has drained by that much.

**The tail.** The estimate is a mean, and the bound is asked of the admitted requests' p99. So the engine also
measures how far off its estimates are: each admitted request that had an estimate reports, at its first token,
its actual wait over the estimate (``observe_first_token``), and the estimate is held against the bound multiplied
by the 99th percentile of the last ``ERROR_WINDOW`` such ratios (``margin``; 1 until ``MIN_ERRORS`` are seen, and
never below 1). Whatever the engine's estimate misses — steps slower than fitted, a noisy machine, requests that
arrive in the same step — widens the margin it keeps. Estimates under ``MIN_ESTIMATE_SHARE`` of the bound are not
counted (their ratios are noise, and they are admitted whatever their ratio).

**Protection**. A request that was preempted is not chosen as a victim again before it has made progress, i.e.
sampled a token after its re-admission (which is where its recomputed prefill ends): otherwise a long prompt,
re-admitted last, is the first victim again each time the decodes ahead of it need blocks, and never gets a token.
Victims are otherwise chosen as before (the scheduler's tail); a protected unit is passed over for the last
unprotected one after it, then for the requester itself; a protected requester with no unprotected unit after it
skips the step, keeping its blocks, while others run. Only when nothing else runs in the step is the old choice
kept, so that the engine always makes progress. Under the priority policy a waiting request with a better priority
passes over the protected running ones as well.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from common.errors import QueueFullError
from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput

RATE_HORIZON_S = 5.0    # busy seconds after which a measurement weighs 1/e of a new one
MIN_STEPS = 8           # steps measured before the step cost is used
MIN_DEPARTURES = 4      # sequences seen ending under a full batch before the seat rate is used
MAX_RETRY_AFTER_S = 60
ERROR_WINDOW = 256          # the last admitted requests whose estimate error sets the margin
MIN_ERRORS = 16             # errors seen before the margin is used
ERROR_QUANTILE = 0.99       # the bound holds the admitted requests' p99
MIN_ESTIMATE_SHARE = 0.1    # of the bound: smaller estimates are not counted

# Refusal reasons counted by ``AdmissionControl.refused`` (the engine's ``sluice:requests_refused`` label).
QUEUE_FULL = "queue_full"
FIRST_TOKEN_WAIT = "first_token_wait"


@dataclass
class DecayingRate:
    """Amount per second over the recent past: decayed sums of amount and of seconds, and their ratio."""

    horizon_s: float = RATE_HORIZON_S
    amount: float = 0.0
    seconds: float = 0.0
    total: float = 0.0    # everything ever added, undecayed: how much evidence the rate rests on
    samples: int = 0

    def add(self, amount: float, seconds: float) -> None:
        keep = math.exp(-seconds / self.horizon_s)
        self.amount = self.amount * keep + amount
        self.seconds = self.seconds * keep + seconds
        self.total += amount
        self.samples += 1

    @property
    def rate(self) -> float | None:
        return self.amount / self.seconds if self.seconds > 0 and self.amount > 0 else None


@dataclass
class StepCost:
    """A step's seconds as ``base_s + per_token_s * prefill tokens``: weighted least squares over the measured steps,
    each weighed by ``exp(-busy seconds since / horizon_s)`` (decayed sums of 1, x, y, x², xy)."""

    horizon_s: float = RATE_HORIZON_S
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    samples: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        keep = math.exp(-seconds / self.horizon_s)
        self.w = self.w * keep + 1
        self.x = self.x * keep + tokens
        self.y = self.y * keep + seconds
        self.xx = self.xx * keep + tokens * tokens
        self.xy = self.xy * keep + tokens * seconds
        self.samples += 1

    def fit(self) -> tuple[float, float]:
        """(base_s, per_token_s); the per-token part is 0 until steps of different sizes (spread over a token)
        show a positive one."""
        mx, my = self.x / self.w, self.y / self.w
        var, cov = self.xx / self.w - mx * mx, self.xy / self.w - mx * my
        per_token = cov / var if var > 1.0 and cov > 0 else 0.0
        return max(0.0, my - per_token * mx), per_token

    def seconds(self, tokens: int, budget: int) -> float:
        """Seconds to compute ``tokens`` prompt tokens in steps of at most ``budget`` tokens."""
        base, per_token = self.fit()
        return math.ceil(tokens / budget) * base + tokens * per_token


@dataclass(frozen=True)
class QueueState:
    """What a new request finds when it arrives: prompt tokens still to compute ahead of it, and how many
    sequences must end before it has a seat (0: one is free for it)."""

    prefill_tokens_ahead: int
    seats_short: int


def queue_state(waiting: Sequence[Request], running: Iterable[Request], free_seats: int) -> QueueState:
    """The state a new request would queue behind: every token not computed yet of the waiting requests, and the
    rest of the running ones' prefills (a decode has one token left to compute, which is not prefill)."""
    ahead = sum(r.num_planned_tokens - r.num_computed_tokens for r in waiting)
    ahead += sum(left for r in running if (left := r.num_planned_tokens - r.num_computed_tokens) > 1)
    return QueueState(ahead, max(0, len(waiting) + 1 - free_seats))


class AdmissionControl:
    """Measures the engine's step cost and seat rate from its steps, and refuses a request whose expected wait for
    its first token exceeds ``max_wait_ms`` (None: measures, never refuses). ``budget``: the most tokens a step
    computes (max_num_batched_tokens); ``clock`` is monotonic seconds."""

    def __init__(self, max_wait_ms: int | None, budget: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_wait_s = None if max_wait_ms is None else max_wait_ms / 1000
        self.budget = budget
        self.clock = clock
        self.steps = StepCost()            # step seconds against the step's prefill tokens
        self.departures = DecayingRate()   # sequences ended per second while the batch was full
        self.refused: dict[str, int] = {QUEUE_FULL: 0, FIRST_TOKEN_WAIT: 0}
        self._last: float | None = None    # when the last step was applied, if the engine had work left then
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)   # admitted requests' actual / expected wait
        self.margin = 1.0

    def observe_first_token(self, waited_s: float, expected_s: float | None) -> None:
        """An admitted request's first token came ``waited_s`` after its arrival; ``expected_s`` was the estimate
        it was admitted on (None: it had none). Updates the margin the estimate is held to."""
        if self.max_wait_s is None or expected_s is None or expected_s < MIN_ESTIMATE_SHARE * self.max_wait_s:
            return
        self._errors.append(waited_s / expected_s)
        if len(self._errors) >= MIN_ERRORS:
            ranked = sorted(self._errors)
            self.margin = max(1.0, ranked[min(len(ranked) - 1, math.ceil(ERROR_QUANTILE * len(ranked)) - 1)])

    def observe_step(self, out: SchedulerOutput, num_ended: int, *, batch_full: bool, busy: bool) -> None:
        """One applied step: ``num_ended`` sequences ended in it, ``batch_full`` when it ran every seat,
        ``busy`` when requests are left (the engine steps again at once; else it may idle, and the time until
        the next step is not service time)."""
        now = self.clock()
        last, self._last = self._last, (now if busy else None)
        if last is None:
            return
        seconds = now - last
        if seconds <= 0:
            return
        self.steps.add(sum(s.num_new_tokens for s in out.scheduled if not s.is_decode), seconds)
        if batch_full:
            self.departures.add(num_ended, seconds)

    def expected_wait_s(self, num_prompt_tokens: int, state: QueueState) -> float | None:
        """Seconds until a new request's first token, from the measured rates; None before any is measured."""
        measured = self.steps.samples >= MIN_STEPS
        seat_rate = self.departures.rate if self.departures.total >= MIN_DEPARTURES else None
        own = self.steps.seconds(num_prompt_tokens, self.budget) if measured else 0.0
        waits = []
        if measured:
            waits.append(self.steps.seconds(state.prefill_tokens_ahead + num_prompt_tokens, self.budget))
        if state.seats_short and seat_rate is not None:
            waits.append(state.seats_short / seat_rate + own)
        return max(waits) if waits else None

    def check(self, num_prompt_tokens: int, waiting: Sequence[Request], running: Iterable[Request],
              free_seats: int) -> float | None:
        """Raise QueueFullError (with ``retry_after_s``) when the expected first-token wait of a new request of
        ``num_prompt_tokens`` behind ``waiting`` and ``running`` (``queue_state``), times the margin, exceeds the
        bound. Returns the estimate it admitted the request on (None: it had none)."""
        if self.max_wait_s is None:
            return None
        state = queue_state(waiting, running, free_seats)
        if state.prefill_tokens_ahead == 0 and state.seats_short == 0:
            return None   # nothing ahead of it: refusing would not shorten its wait (an idle engine measures nothing)
        wait = self.expected_wait_s(num_prompt_tokens, state)
        if wait is None or wait * self.margin <= self.max_wait_s:
            return wait
        self.refused[FIRST_TOKEN_WAIT] += 1
        # By then the backlog ahead of it has drained by the excess.
        retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait * self.margin - self.max_wait_s)))
        raise QueueFullError(f"the engine is overloaded: the expected wait for a first token is {wait * 1000:.0f} "
                             f"ms (x {self.margin:.2f}, the p99 of its recent estimates' error), over the bound of "
                             f"{self.max_wait_s * 1000:.0f} ms (max_expected_ttft_ms); retry in {retry} s",
                             retry_after_s=retry)


class PreemptionGuard:
    """Which preempted sequences have not made progress since: ``mark`` at preemption, ``is_protected`` until
    the sequence holds more tokens than it did then (its pending token, under async scheduling, counts as held)."""

    def __init__(self) -> None:
        self._marks: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def mark(self, request: Request) -> None:
        self._marks[request] = request.num_planned_tokens

    def is_protected(self, request: Request) -> bool:
        mark = self._marks.get(request)
        if mark is None:
            return False
        if request.num_tokens > mark:
            del self._marks[request]
            return False
        return True

    def victim_index(self, units: Sequence[Sequence[Request]], current: int, *, can_wait: bool) -> int | None:
        """The unit to preempt when ``units[current]`` is short of blocks; candidates are it and the units after
        it (not scheduled yet this step): the last unprotected one after it, else itself unless protected. A
        protected one with no such candidate waits for a later step, keeping its blocks (None), when
        ``can_wait``: others run this step, so blocks free up or they, unprotected, give way next time. Else the
        last (the choice without protection): the engine must make room somewhere."""
        for i in range(len(units) - 1, current, -1):
            if not any(self.is_protected(r) for r in units[i]):
                return i
        if not any(self.is_protected(r) for r in units[current]):
            return current
        return None if can_wait else len(units) - 1

    def priority_victim(self, running: Sequence[Request], priority: int) -> Request | None:
        """The running sequence a waiting request of ``priority`` may preempt (priority policy; ``running`` is
        sorted best first): the worst unprotected one with a strictly worse priority (a beam search is protected
        while any of its beams is); None when there is none."""
        for r in reversed(running):
            if r.priority <= priority:
                return None
            unit = r.sequences if r.beam is not None else [r]
            if not any(self.is_protected(s) for s in unit):
                return r
        return None
