"""How results are shown and recorded: the console summary, per-request rows, and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from benchmarks.metrics import LatencyStats, RequestResult, RunSummary


def utc_timestamp() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def alternate(paths: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each path's wall time in ms, ``rounds`` times, the paths taking turns within each round (so a slow
    spell of a shared machine falls on all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def machine_info() -> dict[str, Any]:
    """CPU model (lscpu's 'Model name') and core count: numbers from different machines don't compare."""
    model = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                      if line.startswith("Model name:")), None)
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu_model": model or platform.processor() or None, "cpu_cores": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def request_rows(results: Sequence[RequestResult], with_itls: bool) -> list[dict[str, Any]]:
    """Per-request latencies in ms (for CDFs); times relative to the first request's start."""
    t0 = min((r.start for r in results), default=0.0)
    rows = []
    for r in results:
        row: dict[str, Any] = {"start_s": r.start - t0, "prompt_tokens": r.prompt_tokens,
                               "output_tokens": r.output_tokens, "error": r.error}
        if r.success:
            row.update(ttft_ms=_ms(r.ttft), tpot_ms=_ms(r.tpot), e2el_ms=_ms(r.latency))
            if with_itls:
                row["itls_ms"] = [g * 1000.0 for g in r.itls]
        rows.append(row)
    return rows


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _stat_lines(name: str, s: LatencyStats) -> list[str]:
    lines = [f"{'Mean ' + name + ' (ms):':<40}{_fmt(s.mean_ms):>12}", f"{'Median ' + name + ' (ms):':<40}"
             f"{_fmt(s.median_ms):>12}"]
    lines += [f"{p.upper() + ' ' + name + ' (ms):':<40}{_fmt(v):>12}" for p, v in s.percentiles_ms.items()]
    return lines


def format_summary(s: RunSummary, concurrency: int | None, request_rate: float | None) -> str:
    """A vLLM-style block of text for one sweep step."""
    load = f"concurrency {concurrency}" if request_rate is None else (
        f"request rate {request_rate:g}/s" + (f", max concurrency {concurrency}" if concurrency else ""))
    lines = [f"{' Result: ' + load + ' ':=^52}",
             f"{'Successful requests:':<40}{s.completed:>12}", f"{'Failed requests:':<40}{s.failed:>12}",
             f"{'Benchmark duration (s):':<40}{s.duration_s:>12.2f}",
             f"{'Total input tokens:':<40}{s.total_input_tokens:>12}",
             f"{'Total generated tokens:':<40}{s.total_output_tokens:>12}",
             f"{'Request throughput (req/s):':<40}{s.request_throughput:>12.2f}",
             f"{'Input token throughput (tok/s):':<40}{s.input_throughput:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{s.output_throughput:>12.2f}",
             f"{'Total token throughput (tok/s):':<40}{s.total_token_throughput:>12.2f}"]
    if s.goodput is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{s.goodput:>12.2f}")
    for name, stats in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2EL", s.e2el)):
        lines += _stat_lines(name, stats)
    for message, n in sorted(s.errors.items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"error x{n}: {message}")
    lines.append("=" * 52)
    return "\n".join(lines)
