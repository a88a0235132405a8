from __future__ import annotations

import math

import pytest

from benchmarks.metrics import RequestResult, Slo, latency_stats, parse_slo, summarize

EXACT = 1e-9


def approx(v: float) -> object:
    return pytest.approx(v, rel=EXACT, abs=EXACT)


def recorded_run() -> list[RequestResult]:
    """A recorded fake stream: chunk arrival times and the usage-reported token counts."""
    return [
        # 4 content chunks, usage says 5 tokens (the last chunk held two).
        RequestResult(prompt_tokens=100, start=10.0, chunk_times=(10.2, 10.25, 10.35, 10.4), end=10.5,
                      output_tokens=5),
        # A single token: no TPOT, no ITL.
        RequestResult(prompt_tokens=50, start=10.1, chunk_times=(10.4,), end=10.45, output_tokens=1),
        RequestResult(prompt_tokens=20, start=10.0, chunk_times=(10.1, 10.3, 10.6), end=10.6, output_tokens=3),
        RequestResult(prompt_tokens=10, start=10.0, chunk_times=(), end=10.01, output_tokens=0,
                      error="HTTP 500: boom"),
    ]


def test_per_request_latencies() -> None:
    a, b, c, _ = recorded_run()
    assert a.ttft == approx(0.2) and a.latency == approx(0.5)
    assert a.tpot == approx(0.3 / 4)
    assert a.itls == [approx(0.05), approx(0.1), approx(0.05)]
    assert b.ttft == approx(0.3) and b.tpot is None and b.itls == []
    assert c.tpot == approx(0.25) and c.itls == [approx(0.2), approx(0.3)]


def test_summary_matches_hand_computation() -> None:
    s = summarize(recorded_run(), 2.0)
    assert (s.completed, s.failed) == (3, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (170, 9)
    assert s.request_throughput == approx(1.5)
    assert s.input_throughput == approx(85.0)
    assert s.output_throughput == approx(4.5)
    assert s.total_token_throughput == approx(89.5)
    assert s.errors == {"HTTP 500: boom": 1}
    assert s.goodput is None and s.good_completed is None
    # TTFT [200, 300, 100] ms: sorted [100, 200, 300]; p90 at rank 1.8 -> 280, p99 at 1.98 -> 298.
    assert s.ttft.mean_ms == approx(200.0) and s.ttft.median_ms == approx(200.0)
    assert s.ttft.std_ms == approx(math.sqrt(20000 / 3))
    assert s.ttft.percentiles_ms == {"p50": approx(200.0), "p90": approx(280.0), "p99": approx(298.0)}
    # TPOT [75, 250] ms (the 1-token request has none).
    assert s.tpot.mean_ms == approx(162.5)
    assert s.tpot.percentiles_ms == {"p50": approx(162.5), "p90": approx(232.5), "p99": approx(248.25)}
    # ITL [50, 100, 50, 200, 300] ms: sorted [50, 50, 100, 200, 300]; p90 at rank 3.6 -> 260.
    assert s.itl.mean_ms == approx(140.0) and s.itl.median_ms == approx(100.0)
    assert s.itl.percentiles_ms == {"p50": approx(100.0), "p90": approx(260.0), "p99": approx(296.0)}
    # E2EL [500, 350, 600] ms.
    assert s.e2el.mean_ms == approx(1450 / 3)
    assert s.e2el.percentiles_ms == {"p50": approx(500.0), "p90": approx(580.0), "p99": approx(598.0)}


@pytest.mark.parametrize(("slo", "good"), [
    (Slo(ttft_ms=250, tpot_ms=100), 1),  # b: TTFT 300 > 250; c: TPOT 250 > 100
    (Slo(tpot_ms=100), 2),  # b has one token: no TPOT, it passes
    (Slo(e2el_ms=550), 2),  # c: 600 ms
    (Slo(ttft_ms=301), 3),
    (Slo(ttft_ms=99), 0),
])
def test_goodput(slo: Slo, good: int) -> None:
    s = summarize(recorded_run(), 2.0, slo=slo)
    assert s.good_completed == good
    assert s.goodput == approx(good / 2.0)


def test_slo_bounds_are_inclusive() -> None:
    # Binary-exact times: TTFT 500 ms, TPOT (750 - 500) / 1 = 250 ms, e2e 750 ms.
    r = RequestResult(prompt_tokens=1, start=0.0, chunk_times=(0.5, 0.75), end=0.75, output_tokens=2)
    assert Slo(ttft_ms=500, tpot_ms=250, e2el_ms=750).is_met(r)
    assert not Slo(ttft_ms=499.9).is_met(r)
    assert not Slo(tpot_ms=249.9).is_met(r)
    assert not Slo(e2el_ms=749.9).is_met(r)


def test_custom_percentiles_and_dict_keys() -> None:
    s = summarize(recorded_run(), 2.0, percentiles=[25, 75])
    assert s.ttft.percentiles_ms == {"p25": approx(150.0), "p75": approx(250.0)}
    d = s.to_dict()
    assert d["ttft"] == {"mean_ms": approx(200.0), "median_ms": approx(200.0), "std_ms": approx(math.sqrt(20000 / 3)),
                         "p25_ms": approx(150.0), "p75_ms": approx(250.0)}
    assert d["completed"] == 3 and d["errors"] == {"HTTP 500: boom": 1}


def test_empty_samples_give_none() -> None:
    stats = latency_stats([], [50, 99])
    assert (stats.mean_ms, stats.median_ms, stats.std_ms) == (None, None, None)
    assert stats.percentiles_ms == {"p50": None, "p99": None}
    s = summarize([RequestResult(prompt_tokens=1, start=0.0, chunk_times=(), end=1.0, output_tokens=0,
                                 error="x")], 1.0)
    assert (s.completed, s.failed, s.output_throughput, s.ttft.mean_ms) == (0, 1, 0.0, None)


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError):
        RequestResult(prompt_tokens=1, start=0.0, chunk_times=(), end=1.0, output_tokens=0)
    with pytest.raises(ValueError):
        summarize(recorded_run(), 0.0)


def test_parse_slo() -> None:
    assert parse_slo(["ttft:500", "tpot:50"]) == Slo(ttft_ms=500.0, tpot_ms=50.0)
    assert parse_slo(["E2E:1000"]) == Slo(e2el_ms=1000.0)
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_slo(bad)
