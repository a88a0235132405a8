"""benchmarks/amx_linear.py end to end on a small model (AMX CPUs; elsewhere it says it cannot run)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.amx_linear import main
from engine.kernels import cpu_ops


def test_times_both_paths_and_reports_how_far_apart_they_are(tmp_path: Path) -> None:
    out = tmp_path / "linear.json"
    ops = cpu_ops()
    code = main(["--rows", "3,40", "--layers", "2", "--vocab", "256", "--rounds", "2", "--out", str(out)])
    if ops is None or not ops.has_amx_linear():
        assert code == 2 and not out.exists()
        return
    assert code == 0
    result = json.loads(out.read_text())
    assert result["weight_bytes"] == 2 * 2 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) + 2 * 256 * 576
    for rows in ("3", "40"):
        row = result["rows"][rows]
        assert set(row["median_ms"]) == {"onednn", "amx"} and all(ms > 0 for ms in row["median_ms"].values())
        assert all(len(times) == 2 for times in row["rounds_ms"].values())
        # The same products, each rounded once to bfloat16 (a step: 1/16 at |y| in [8, 16)); a wrong one is off by O(1).
        assert row["max_abs_diff"] < 0.25
