"""Benchmark arithmetic: per-request latencies and the summary of a run, defined as vLLM's
benchmark_serving defines them so numbers compare with published ones. Pure: no I/O, no clocks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class RequestResult:
    """What the client saw for one request. Times are seconds on one monotonic clock."""

    prompt_tokens: int
    start: float
    # Arrival time of each chunk that carried content (non-empty text): the tokens the user sees.
    chunk_times: tuple[float, ...]
    end: float
    # From the final `usage` chunk when the server sent one, else len(chunk_times).
    output_tokens: int
    error: str | None = None

    def __post_init__(self) -> None:
        if self.error is None and not self.chunk_times:
            raise ValueError("a successful request has at least one content chunk")

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with a single token (undefined)."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks (a chunk may hold several tokens)."""
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput, in milliseconds; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def is_met(self, r: RequestResult) -> bool:
        # As vLLM: a request with one output token has no TPOT and passes that objective.
        tpot = r.tpot or 0.0
        return ((self.ttft_ms is None or r.ttft * 1000.0 <= self.ttft_ms)
                and (self.tpot_ms is None or tpot * 1000.0 <= self.tpot_ms)
                and (self.e2el_ms is None or r.latency * 1000.0 <= self.e2el_ms))


_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms", "e2e": "e2el_ms"}


def parse_slo(items: Iterable[str]) -> Slo:
    """Parse ``["ttft:500", "tpot:50"]`` (milliseconds) into an Slo."""
    values: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key.strip().lower() not in _SLO_KEYS:
            raise ValueError(f"bad goodput objective {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"goodput objective {item!r} must be >= 0 ms")
        values[_SLO_KEYS[key.strip().lower()]] = ms
    return Slo(**values)


@dataclass(frozen=True)
class LatencyStats:
    """Statistics of one latency in milliseconds; all None when there was no sample."""

    mean_ms: float | None
    median_ms: float | None
    std_ms: float | None
    percentiles_ms: dict[str, float | None]  # "p50" -> value

    def to_dict(self) -> dict[str, object]:
        return {"mean_ms": self.mean_ms, "median_ms": self.median_ms, "std_ms": self.std_ms,
                **{f"{k}_ms": v for k, v in self.percentiles_ms.items()}}


def percentile_label(p: float) -> str:
    return f"p{p:g}"


def latency_stats(seconds: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> LatencyStats:
    """Mean, median, std and percentiles (numpy's default linear interpolation) in ms."""
    if not seconds:
        return LatencyStats(None, None, None, {percentile_label(p): None for p in percentiles})
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return LatencyStats(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                        {percentile_label(p): float(np.percentile(ms, p)) for p in percentiles})


@dataclass(frozen=True)
class RunSummary:
    """The summary of one benchmark run (one concurrency or one request rate)."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    good_completed: int | None = None  # requests meeting the SLO; None without an SLO
    goodput: float | None = None  # good_completed / s
    errors: dict[str, int] = field(default_factory=dict)  # error message -> count

    def to_dict(self) -> dict[str, object]:
        return {
            "completed": self.completed, "failed": self.failed, "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput, "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput, "total_token_throughput": self.total_token_throughput,
            "ttft": self.ttft.to_dict(), "tpot": self.tpot.to_dict(), "itl": self.itl.to_dict(),
            "e2el": self.e2el.to_dict(), "good_completed": self.good_completed, "goodput": self.goodput,
            "errors": dict(self.errors),
        }


def summarize(results: Sequence[RequestResult], duration_s: float, *,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES, slo: Slo | None = None) -> RunSummary:
    """Aggregate the requests of one run that lasted ``duration_s`` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = None if slo is None else sum(1 for r in ok if slo.is_met(r))
    return RunSummary(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s, input_throughput=total_in / duration_s,
        output_throughput=total_out / duration_s, total_token_throughput=(total_in + total_out) / duration_s,
        ttft=latency_stats([r.ttft for r in ok], percentiles),
        tpot=latency_stats([t for r in ok if (t := r.tpot) is not None], percentiles),
        itl=latency_stats([g for r in ok for g in r.itls], percentiles),
        e2el=latency_stats([r.latency for r in ok], percentiles),
        good_completed=good, goodput=None if good is None else good / duration_s,
        errors=errors,
    )
