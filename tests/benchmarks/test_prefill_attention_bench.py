"""benchmarks/prefill_attention.py end to end on small shapes (AMX or AVX512-BF16 CPUs; elsewhere it says it
cannot run)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.prefill_attention import main
from engine.kernels import cpu_ops


def test_times_both_paths_and_reports_how_far_apart_they_are(tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    ops = cpu_ops()
    code = main(["--shapes", "2x40,1x70", "--rounds", "2", "--out", str(out)])
    kernels = set()
    if ops is not None and ops.has_amx_attention():
        kernels.add("amx")
    if ops is not None and ops.has_bf16_attention():
        kernels.add("bf16")
    if not kernels:
        assert code == 2 and not out.exists()
        return
    assert code == 0
    result = json.loads(out.read_text())
    for shape in ("2x40", "1x70"):
        row = result["shapes"][shape]
        assert set(row["median_ms"]) == {"sdpa"} | kernels and all(ms > 0 for ms in row["median_ms"].values())
        assert all(len(times) == 2 for times in row["rounds_ms"].values())
        assert row["max_abs_diff"] < 0.05  # the same attention, probabilities rounded to bfloat16
