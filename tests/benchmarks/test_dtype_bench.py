"""benchmarks/dtype.py's arithmetic (no engine: the summary of recorded runs)."""
from __future__ import annotations

import pytest

from benchmarks.dtype import summarize


def test_summary_medians_and_per_round_ratios_against_the_first_dtype() -> None:
    runs = {
        "float32": [{"prefill_s": 4.0, "full_s": 16.0, "tok_per_s": 256.0},
                    {"prefill_s": 5.0, "full_s": 15.0, "tok_per_s": 280.0},
                    {"prefill_s": 4.5, "full_s": 14.0, "tok_per_s": 300.0}],
        "bfloat16": [{"prefill_s": 0.5, "full_s": 6.0, "tok_per_s": 640.0},
                     {"prefill_s": 1.0, "full_s": 5.0, "tok_per_s": 700.0},
                     {"prefill_s": 0.9, "full_s": 7.0, "tok_per_s": 600.0}],
    }
    out = summarize(runs)
    assert out["median"]["float32"] == {"prefill_s": 4.5, "full_s": 15.0, "tok_per_s": 280.0}
    assert out["median"]["bfloat16"] == {"prefill_s": 0.9, "full_s": 6.0, "tok_per_s": 640.0}
    assert out["ratios"]["float32"]["throughput"] == [1.0, 1.0, 1.0]
    assert out["ratios"]["bfloat16"]["prefill_speedup"] == pytest.approx([8.0, 5.0, 5.0])
    assert out["ratios"]["bfloat16"]["throughput"] == pytest.approx([2.5, 2.5, 2.0])


def test_rounds_must_line_up() -> None:
    with pytest.raises(ValueError):
        summarize({"float32": [{"prefill_s": 1.0, "full_s": 1.0, "tok_per_s": 1.0}], "bfloat16": []})
