"""benchmarks/roofline.py end to end on a tiny Llama shape: its GPTQ checkpoint loads into the 4-bit method, the
bytes it counts are the methods' own, and every format reports a step and a roofline."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import roofline


def test_each_format_decodes_against_the_bytes_its_linears_hold(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # hidden 128, MLP 256, 2 layers, 4 query / 2 KV heads (head dim 32), vocabulary 512
    monkeypatch.setitem(roofline.SHAPES, "tiny", (128, 256, 2, 4, 2, 512))
    out = tmp_path / "roofline.json"
    code = roofline.main(["--shapes", "tiny", "--rounds", "1", "--tokens", "4", "--threads", "1",
                          "--dir", str(tmp_path / "ckpt"), "--out", str(out)])
    assert code == 0
    results = {r["format"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"bf16", "w8a8", "int4"}
    projections = 2 * (128 * 128 * 2 + 64 * 128 * 2 + 3 * 128 * 256)   # q, o; k, v; gate, up, down
    lm_head = 512 * 128
    assert results["bf16"]["held_bytes"] == 2 * (projections + lm_head)
    # int4: half a byte per weight and a bfloat16 scale and offset per group of 128 and output; lm_head bfloat16
    groups = 2 * (2 * 128 + 2 * 64 + 2 * 256 + 2 * 128)    # (out features x groups) summed over the projections
    assert results["int4"]["held_bytes"] == projections // 2 + 2 * 2 * groups + 2 * lm_head
    for r in results.values():
        assert r["step_ms"] > 0 and r["roofline_ms"] > 0
        assert r["breakdown"]["linears_ms"] > 0 and r["breakdown"]["lm_head_ms"] > 0
