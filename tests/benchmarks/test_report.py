"""benchmarks/report.py helpers."""
from __future__ import annotations

import time

from benchmarks.report import alternate


def test_alternate_takes_turns_and_times_each_call() -> None:
    calls: list[str] = []

    def slow() -> None:
        calls.append("slow")
        time.sleep(0.02)

    times = alternate({"fast": lambda: calls.append("fast"), "slow": slow}, rounds=3)
    assert calls == ["fast", "slow"] * 3  # in turn within every round, not all of one path first
    assert set(times) == {"fast", "slow"} and all(len(v) == 3 for v in times.values())
    assert min(times["slow"]) >= 20.0 > max(times["fast"])  # milliseconds, each call's own
