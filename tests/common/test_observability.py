"""common/observability.py: the tracing and logging flags on every entry point, refused where Sluice cannot honour
them, and handed by `sluice serve` to its children."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from common.observability import (
    ObservabilitySettings,
    add_observability_args,
    observability_flags,
    observability_settings,
)
from services import supervisor
from tests.procs import ROOT


def _parse(*argv: str, environ: dict[str, str] | None = None) -> ObservabilitySettings:
    parser = argparse.ArgumentParser()
    add_observability_args(parser)
    return observability_settings(parser.parse_args(list(argv)), {} if environ is None else environ)


def test_defaults_trace_nothing_log_text_and_no_request_lines() -> None:
    assert _parse() == ObservabilitySettings(otlp_traces_endpoint=None, log_format="text", log_requests=False)


def test_flags_and_the_otel_variable() -> None:
    assert _parse("--otlp-traces-endpoint", "http://c:4317").otlp_traces_endpoint == "http://c:4317"
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4317"}
    assert _parse(environ=env).otlp_traces_endpoint == "http://env:4317"
    assert _parse("--enable-log-requests").log_requests
    assert not _parse("--enable-log-requests", "--disable-log-requests").log_requests  # the last one wins
    assert _parse("--log-format", "json").log_format == "json"


def test_flags_round_trip_through_a_childs_parser() -> None:
    settings = ObservabilitySettings(otlp_traces_endpoint="https://c:4317", log_format="json", log_requests=True)
    assert _parse(*observability_flags(settings)) == settings
    assert _parse(*observability_flags(ObservabilitySettings())) == ObservabilitySettings()


def test_detailed_traces_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--collect-detailed-traces: Sluice has no model or worker sub-spans"):
        _parse("--collect-detailed-traces", "all")


@pytest.mark.parametrize("module", ["gateway", "services.tokenizer", "engine"])
def test_each_process_refuses_detailed_traces_with_a_message(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--collect-detailed-traces", "model"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--collect-detailed-traces: Sluice has no model or worker sub-spans" in out.stderr
    assert "Traceback" not in out.stderr


def test_sluice_serve_refuses_detailed_traces() -> None:
    with pytest.raises(SystemExit, match="sluice serve: --collect-detailed-traces"):
        supervisor.main(["--collect-detailed-traces", "all"])


def test_sluice_serve_hands_the_flags_to_every_child() -> None:
    ns = supervisor.resolve_settings(["--tokenizers", "2", "--otlp-traces-endpoint", "http://c:4317",
                                      "--log-format", "json", "--enable-log-requests"])
    sup = supervisor.Supervisor(ns, supervisor.config_from_args(ns), observability_settings(ns, {}))
    for child in sup.children:
        parsed = _parse(*child.argv[child.argv.index("--log-format"):][:5])
        assert parsed.otlp_traces_endpoint == "http://c:4317"
        assert parsed.log_format == "json"
        # Request lines from the gateways and the engine, as vLLM's API server and engine log them.
        assert parsed.log_requests is not child.name.startswith("tokenizer")
