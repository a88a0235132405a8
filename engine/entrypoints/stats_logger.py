"""The engine's periodic status line, in vLLM's words so that its users read it at a glance:

    Avg prompt throughput: 409.6 tokens/s, Avg generation throughput: 171.1 tokens/s, Running: 32 reqs,
    Waiting: 0 reqs, KV cache usage: 17.6%, Prefix cache hit rate: 0.0%, Steps: 73 (mean 121.4 ms, busy 98%)

"busy" is the share of the interval spent inside ``EngineCore.step``: below 100 % while requests are
running means time lost outside the model (queues, gRPC, other processes taking the cores). With speculative
decoding, an interval that verified drafts adds vLLM's ``Mean acceptance length: 2.31, Avg Draft acceptance
rate: 65.2%`` over its drafts (engine.core.spec_stats says how they are counted).
Nothing is logged over an interval with no step. ``--disable-log-stats`` turns it off.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("engine.stats")

DEFAULT_INTERVAL_S = 10.0


class StatsLogger:
    def __init__(self, core: Any, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._base = core.scheduler_stats()
        self._steps = 0
        self._busy_s = 0.0

    def record_step(self, duration_s: float) -> None:
        self._steps += 1
        self._busy_s += duration_s

    def maybe_log(self) -> str | None:
        """Log (and return) the line once ``interval_s`` has passed since the last one; None otherwise."""
        now = self._clock()
        elapsed = now - self._start
        if elapsed < self.interval_s:
            return None
        stats = self.core.scheduler_stats()
        line = None
        if self._steps:
            line = self.format(stats, elapsed)
            logger.info(line)
        self._start, self._base, self._steps, self._busy_s = now, stats, 0, 0.0
        return line

    def format(self, stats: dict[str, int], elapsed: float) -> str:
        base = self._base
        prompt = (stats["prompt_tokens"] - base["prompt_tokens"]) / elapsed
        generation = (stats["generation_tokens"] - base["generation_tokens"]) / elapsed
        queries = stats["prefix_cache_queries"] - base["prefix_cache_queries"]
        hits = stats["prefix_cache_hits"] - base["prefix_cache_hits"]
        info = self.core.info()
        total = max(int(info["total_kv_blocks"]), 1)
        usage = 100.0 * (total - int(info["free_kv_blocks"])) / total
        mean_ms = 1000.0 * self._busy_s / self._steps
        line = (f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {generation:.1f} tokens/s, "
                f"Running: {info['num_running']} reqs, Waiting: {info['num_waiting']} reqs, "
                f"KV cache usage: {usage:.1f}%, "
                f"Prefix cache hit rate: {100.0 * hits / queries if queries else 0.0:.1f}%, "
                f"Steps: {self._steps} (mean {mean_ms:.1f} ms, busy {100.0 * self._busy_s / elapsed:.0f}%)")
        return line + self._spec_decode(stats)

    def _spec_decode(self, stats: dict[str, int]) -> str:
        """The interval's acceptance, in vLLM's words; empty with speculation off or no draft in the interval."""
        if "spec_decode_num_drafts" not in stats:
            return ""
        base = self._base
        drafts = stats["spec_decode_num_drafts"] - base["spec_decode_num_drafts"]
        draft_tokens = stats["spec_decode_num_draft_tokens"] - base["spec_decode_num_draft_tokens"]
        accepted = stats["spec_decode_num_accepted_tokens"] - base["spec_decode_num_accepted_tokens"]
        if drafts <= 0 or draft_tokens <= 0:
            return ""
        return (f", Mean acceptance length: {1.0 + accepted / drafts:.2f}, "
                f"Avg Draft acceptance rate: {100.0 * accepted / draft_tokens:.1f}%")
