"""The periodic vLLM-style status line (engine/stats_logger.py)."""
from __future__ import annotations

import argparse
import logging
from typing import Any

import pytest

from engine.entrypoints.args import add_engine_args, config_from_args
from engine.entrypoints.stats_logger import StatsLogger


class FakeCore:
    def __init__(self) -> None:
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_cache_queries": 0,
                      "prefix_cache_hits": 0, "num_preemptions": 0, "steps": 0}
        self.info_values: dict[str, Any] = {"total_kv_blocks": 200, "free_kv_blocks": 150, "num_running": 3,
                                            "num_waiting": 1}

    def scheduler_stats(self) -> dict[str, int]:
        return dict(self.stats)

    def info(self) -> dict[str, Any]:
        return dict(self.info_values)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_line_reports_rates_usage_and_busy_share(caplog: pytest.LogCaptureFixture) -> None:
    core, clock = FakeCore(), Clock()
    stats = StatsLogger(core, interval_s=10.0, clock=clock)
    for _ in range(4):
        stats.record_step(0.5)
    core.stats.update(prompt_tokens=1000, generation_tokens=250, prefix_cache_queries=8, prefix_cache_hits=2)
    clock.now += 9.9
    assert stats.maybe_log() is None  # not yet
    clock.now += 0.1
    with caplog.at_level(logging.INFO, logger="engine.stats"):
        line = stats.maybe_log()
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 25.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, "
                    "Steps: 4 (mean 500.0 ms, busy 20%)")
    assert line in caplog.text
    # The next interval counts from here: only the new tokens, and nothing at all without a step.
    core.stats.update(generation_tokens=450)
    clock.now += 10.0
    assert stats.maybe_log() is None
    stats.record_step(1.0)
    core.stats.update(generation_tokens=650)
    clock.now += 10.0
    line = stats.maybe_log()
    assert (line is not None and "Avg generation throughput: 20.0 tokens/s" in line
            and "Steps: 1 (mean 1000.0 ms" in line)


def test_speculation_adds_the_intervals_acceptance_in_vllms_words() -> None:
    core, clock = FakeCore(), Clock()
    core.stats.update(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30, spec_decode_num_accepted_tokens=30)
    stats = StatsLogger(core, interval_s=10.0, clock=clock)
    stats.record_step(0.5)
    # This interval: 13 drafts of 3 tokens (39), 17 of them accepted.
    core.stats.update(spec_decode_num_drafts=23, spec_decode_num_draft_tokens=69, spec_decode_num_accepted_tokens=47)
    clock.now += 10.0
    line = stats.maybe_log()
    assert line is not None and line.endswith(
        "busy 5%), Mean acceptance length: 2.31, Avg Draft acceptance rate: 43.6%")
    stats.record_step(0.5)   # speculation on, but no draft in the interval: nothing added
    clock.now += 10.0
    line = stats.maybe_log()
    assert line is not None and line.endswith("busy 5%)")


def test_disable_log_stats_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).disable_log_stats is False
    assert config_from_args(parser.parse_args(["--disable-log-stats"])).disable_log_stats is True


def test_sluice_serve_passes_disable_log_stats_to_the_engine() -> None:
    from engine.config import EngineConfig, default_max_queued_requests
    from services.supervisor import engine_flags

    assert "--disable-log-stats" not in engine_flags(EngineConfig())
    flags = engine_flags(EngineConfig(disable_log_stats=True, max_num_seqs=64, enable_prefix_caching=False,
                                      max_queued_requests=default_max_queued_requests(64)))
    assert flags == ["--max-num-seqs", "64", "--no-enable-prefix-caching", "--disable-log-stats"]
