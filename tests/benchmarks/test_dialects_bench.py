"""benchmarks/dialects.py: the two sides' requests ask for the same greedy generation, and the ratios."""

from __future__ import annotations

import pytest

from benchmarks.dialects import Run, markdown, request, summarize, text_of
from gateway.routes.dialects.tgi import parse_tgi
from gateway.schemas import parse_completion


def test_both_sides_ask_for_the_same_generation() -> None:
    url, openai_body = request("openai", "http://h", "m", "Hi there", 64)
    assert url == "http://h/v1/completions"
    url, tgi_body = request("tgi", "http://h", "m", "Hi there", 64)
    assert url == "http://h/generate"
    tgi, completion = parse_tgi(tgi_body, 16).gen, parse_completion(openai_body, 16)
    assert (tgi.prompts, tgi.params) == (completion.prompts, completion.params)
    assert text_of("openai", {"choices": [{"text": "x"}]}) == text_of("tgi", {"generated_text": "x"}) == "x"


def test_summary() -> None:
    runs = [Run("openai", 0, 10.0, 64, 4000, {"gateway": 0.64}), Run("tgi", 0, 10.0, 64, 3960, {"gateway": 0.704}),
            Run("tgi", 1, 10.0, 64, 4100, {"gateway": 0.576}), Run("openai", 1, 10.0, 64, 4000, {"gateway": 0.64})]
    s = summarize(runs)
    assert s["median_output_tok_s"] == {"openai": 400.0, "tgi": 403.0}
    assert s["tgi_over_openai_median"] == pytest.approx(403 / 400)
    assert s["tgi_over_openai_per_round"] == pytest.approx([0.99, 1.025])
    assert s["median_gateway_cpu_ms_per_request"] == pytest.approx({"openai": 10.0, "tgi": 10.0})
    assert ("TGI ÷ OpenAI output tok/s, medians: 1.008; per round: 0.990, 1.025 (median 1.007). Gateway CPU per "
            "request, medians: OpenAI 10.00 ms, TGI 10.00 ms.") in markdown(runs, s)
