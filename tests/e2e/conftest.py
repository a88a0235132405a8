"""One `sluice serve` of the default model shared by the metrics and speculative-decoding end-to-end tests: a
stack costs ~15 s to start, and n-gram speculation leaves every greedy output as it is without it."""
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
                   "--speculative-config", json.dumps(SPEC_CONFIG)).start()
    yield s
    s.stop()
