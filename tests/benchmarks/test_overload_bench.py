"""benchmarks/overload.py's summary of one load point, from outcomes made by hand."""

from __future__ import annotations

import pytest

from benchmarks.overload import Outcome, percentile, summarize


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_summary_counts_admitted_refused_and_failed_and_the_completed_rate() -> None:
    error = {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    outcomes = [Outcome(0.0, 200, ttft=0.2, ended=1.0, tokens=16), Outcome(0.5, 200, ttft=0.4, ended=2.0, tokens=16),
                Outcome(1.0, 429, ended=1.1, retry_after="1", error=error), Outcome(1.5, -1, ended=1.6)]
    s = summarize(outcomes)
    assert (s["offered"], s["admitted"], s["refused"], s["failed"]) == (4, 2, 1, 1)
    assert s["refusals_well_formed"] and s["ttft_p50_s"] == 0.2 and s["ttft_p99_s"] == 0.4
    assert s["throughput_rps"] == pytest.approx(2 / 2.0)
    outcomes[2].retry_after = None
    assert not summarize(outcomes)["refusals_well_formed"]
