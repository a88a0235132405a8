from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import plot


def result_doc(label: str, mode: str = "closed") -> dict[str, Any]:
    def run(x: float, tput: float, p99: float | None) -> dict[str, Any]:
        return {"mode": mode, "concurrency": int(x) if mode == "closed" else None,
                "request_rate": x if mode == "open" else None, "output_throughput": tput,
                "ttft": {"p50_ms": 1.0, "p99_ms": p99}, "requests": [
                    {"ttft_ms": 10.0, "e2el_ms": 30.0}, {"ttft_ms": 20.0, "e2el_ms": 50.0}, {"error": "x"}]}
    return {"label": label, "machine": {"cpu_model": "CPU", "cpu_cores": 2},
            "runs": [run(1, 10.0, 100.0), run(8, 50.0, None)]}


def test_series_and_axis() -> None:
    doc = result_doc("a")
    assert plot.load_axis(doc) == ("concurrency", [1.0, 8.0])
    assert plot.series(doc, "output_throughput", 99) == [10.0, 50.0]
    assert plot.series(doc, "ttft", 99) == [100.0, None]
    assert plot.series(doc, "ttft", 50) == [1.0, 1.0]
    assert plot.load_axis(result_doc("b", "open")) == ("request rate (req/s)", [1.0, 8.0])
    assert plot.cdf([3.0, 1.0, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])


def test_main_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files = []
    for label in ("sluice", "vllm"):
        f = tmp_path / f"{label}.json"
        f.write_text(json.dumps(result_doc(label)), encoding="utf-8")
        files.append(str(f))
    out = tmp_path / "sub" / "x.png"
    assert plot.main([*files, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
