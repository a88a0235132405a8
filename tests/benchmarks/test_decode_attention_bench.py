"""benchmarks/decode_attention.py end to end on a tiny cache: it runs the paths this CPU has and reports each."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.decode_attention import main
from engine.kernels import cpu_ops


def test_reports_every_path_this_cpu_has(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    assert main(["--seqs", "2,3", "--seq-len", "20", "--layers", "2", "--blocks", "16", "--rounds", "2",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    ops = cpu_ops()
    paths = {"vector", "amx"} if ops is not None and ops.has_amx_attention() else {"vector"}
    for n in ("2", "3"):
        row = result["ms_per_call"][n]
        assert set(row["median"]) == paths and all(ms > 0 for ms in row["median"].values())
        assert all(len(times) == 2 for times in row["rounds"].values())
    if "amx" in paths:
        assert ops.set_amx_attention(True) is True  # the benchmark leaves the AMX path on
