"""One `sluice serve` of the default model shared by the metrics and speculative-decoding end-to-end tests: a
stack costs ~15 s to start, and n-gram speculation leaves every greedy output as it is without it. It parses tool
calls (Hermes) for the Responses API's agent test; requests without tools are untouched by that."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.procs import ServeStack

SHARED_SERVED = "metrics-model"
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeStack]:
    s = ServeStack(tmp_path_factory.mktemp("shared"), "--served-model-name", SHARED_SERVED, "--max-num-seqs", "2",
                   "--speculative-config", json.dumps(SPEC_CONFIG),
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes").start()
    yield s
    s.stop()
