"""One `sluice serve` of the default model shared by the metrics and speculative-decoding end-to-end tests: a
stack costs ~15 s to start, and n-gram speculation leaves every greedy output as it is without it. It parses tool
calls (Hermes) for the Responses API's agent test; requests without tools are untouched by that."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.otlp_collector import Collector, serve_collector
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


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[tuple[Collector, str]]:
    with serve_collector() as served:
        yield served


@pytest.fixture(scope="session")
def traced_stack(tmp_path_factory: pytest.TempPathFactory, otlp_collector: tuple[Collector, str]
                 ) -> Iterator[ServeStack]:
    """The default model in float32 (the request API's logprobs are compared with transformers'), exporting its
    traces to ``otlp_collector`` and logging JSON lines with each request: one stack for test_request_api.py and
    test_tracing.py, whose requests and checks are untouched by the other's flags."""
    with pytest.MonkeyPatch.context() as env:   # what `sluice serve` inherits; this process keeps its own
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # milliseconds between exports
        env.delenv("OTEL_SERVICE_NAME", raising=False)
        s = ServeStack(tmp_path_factory.mktemp("traced"), "--dtype", "float32", "--max-num-seqs", "16",
                       "--kv-cache-memory", "512MiB", "--otlp-traces-endpoint", otlp_collector[1],
                       "--log-format", "json", "--enable-log-requests").start()
    yield s
    s.stop()
