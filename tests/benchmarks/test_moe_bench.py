"""benchmarks/moe_step.py end to end at a small size: the MoE model, its dense twin and transformers' step are all
timed, and the report holds each figure the docs quote."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.moe_step import main


def test_times_moe_dense_and_transformers_and_reports_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    assert main(["--num-seqs", "2", "--layers", "1", "--experts", "8", "--vocab", "256", "--context", "8",
                 "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    [row] = result["decode"]
    assert row["num_seqs"] == 2
    assert all(row[key] > 0 for key in ("moe_ms", "dense_ms", "transformers_ms"))
    # The ratio (to 0.01) is of the unrounded times, which are reported to 0.01 ms.
    moe, dense = row["moe_ms"], row["dense_ms"]
    assert (moe - 0.005) / (dense + 0.005) - 0.005 <= row["moe_over_dense"] <= (moe + 0.005) / (dense - 0.005) + 0.005
    assert result["read_bandwidth_gb_s"] > 0
