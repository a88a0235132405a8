"""common/tracing.py: W3C propagation through a dict carrier, clock conversion, and no opentelemetry import in a
process started without an endpoint."""

from __future__ import annotations

import textwrap
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.tracing import Tracing, epoch_ns, init_tracing, trace_headers_of, traces_endpoint
from tests.procs import python_outputs


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # not the global one: each test its own
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, provider.get_tracer("test")), exporter


def test_a_span_injected_into_a_carrier_parents_the_span_extracted_from_it() -> None:
    tracing, exporter = _tracing()
    parent = tracing.start_span("parent")
    carrier: dict[str, str] = {}
    tracing.inject(parent, carrier)
    ctx = parent.get_span_context()
    assert carrier["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    child = tracing.start_span("child", parent=carrier, attributes={"gen_ai.request.id": "r1"})
    child.end()
    parent.end()
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert finished["child"].context.trace_id == ctx.trace_id
    assert finished["child"].parent is not None and finished["child"].parent.span_id == ctx.span_id
    assert finished["child"].attributes == {"gen_ai.request.id": "r1"}
    assert finished["parent"].parent is None


def test_the_current_span_is_what_inject_current_writes() -> None:
    tracing, _ = _tracing()
    outer: dict[str, str] = {}
    tracing.inject_current(outer)
    assert outer == {}  # no current span: nothing to propagate
    span = tracing.start_span("request")
    token = tracing.attach(span)
    try:
        carrier: dict[str, str] = {}
        tracing.inject_current(carrier)
    finally:
        tracing.detach(token)
    assert carrier["traceparent"].split("-")[2] == f"{span.get_span_context().span_id:016x}"


def test_no_carrier_or_a_broken_one_starts_a_root_span() -> None:
    tracing, exporter = _tracing()
    for parent in (None, {}, {"traceparent": "not a traceparent"}):
        tracing.start_span("root", parent=parent).end()
    assert [s.parent for s in exporter.get_finished_spans()] == [None, None, None]


def test_client_tracestate_travels_with_traceparent() -> None:
    tracing, _ = _tracing()
    incoming = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01", "tracestate": "vendor=1"}
    span = tracing.start_span("gateway", parent=incoming)
    carrier: dict[str, str] = {}
    tracing.inject(span, carrier)
    assert carrier["traceparent"].startswith(f"00-{'ab' * 16}-")
    assert carrier["tracestate"] == "vendor=1"


def test_trace_headers_of_keeps_only_w3c_entries() -> None:
    assert trace_headers_of({"traceparent": "t", "tracestate": "s", "x-request-id": "r"}) == {
        "traceparent": "t", "tracestate": "s"}


def test_the_endpoint_comes_from_the_flag_else_the_otel_variable() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}
    assert traces_endpoint("http://flag:4317", env) == "http://flag:4317"
    assert traces_endpoint(None, env) == "http://collector:4317"
    assert traces_endpoint(None, {}) is None
    assert init_tracing(None, "sluice-test") is None


def test_epoch_ns_converts_the_monotonic_clock() -> None:
    now_mono, now_epoch = time.monotonic(), time.time_ns()
    assert abs(epoch_ns(now_mono) - now_epoch) < 50_000_000
    assert abs(epoch_ns(now_mono + 1.5) - epoch_ns(now_mono) - 1_500_000_000) < 1_000_000


_SET_UP = """
    import sys
    from common.observability import ObservabilitySettings, set_up
    from engine.entrypoints.grpc_servicer import EngineServicer
    from gateway.app import create_app
    from gateway.settings import GatewaySettings
    from services.tokenizer.service import GenerationServicer

    tracing = set_up(ObservabilitySettings(otlp_traces_endpoint={endpoint!r}), log_level="warning",
                     process="test")
    create_app(GatewaySettings(), tracing=tracing)
    print(sorted({{m.split(".")[0] for m in sys.modules if m.startswith("opentelemetry")}}))
    if tracing is not None:
        tracing.shutdown()
"""


def test_a_process_without_an_endpoint_never_imports_opentelemetry() -> None:
    """Every server's modules imported and set up as without the flag; with it (the control) it is loaded."""
    scripts = [textwrap.dedent(_SET_UP.format(endpoint=e)) for e in (None, "http://127.0.0.1:9")]
    assert python_outputs(*((["-c", script], {}) for script in scripts)) == ["[]", "['opentelemetry']"]
