"""engine/entrypoints/request_observer.py: the engine's span is placed at the core's recorded times, carries vLLM's
attributes, and covers the paths where a request never ran; the request lines carry its id."""

from __future__ import annotations

import logging
import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from common.tracing import Tracing
from engine.core.finish_reason import FinishReason
from engine.core.outputs import EngineCoreOutput
from engine.core.request import RequestTimes
from engine.core.sampling_params import SamplingParams
from engine.entrypoints.request_observer import RequestObserver

PARENT = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}


def _observe(out: EngineCoreOutput, params: SamplingParams | None = None, label: str | None = None) -> ReadableSpan:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = RequestObserver("smol", tracing=Tracing(provider, provider.get_tracer("t")), log_requests=False)
    observer.finished(out, label or out.request_id, PARENT, 7,
                      params or SamplingParams(n=2, temperature=0.5, top_p=0.9, max_tokens=9))
    (span,) = exporter.get_finished_spans()
    return span


def test_the_span_sits_at_the_recorded_times_with_vllms_attributes() -> None:
    t = time.monotonic()
    times = RequestTimes(arrival=t, first_scheduled=t + 0.25, first_token=t + 0.5, finished=t + 2.0,
                         num_preemptions=1, num_generation_tokens=12)
    span = _observe(EngineCoreOutput("r1", [5], finish_reason=FinishReason.LENGTH, request_finished=True,
                                     times=times))
    assert span.name == "llm_request"
    assert span.parent is not None and span.parent.span_id == int("2" * 16, 16)
    assert span.context.trace_id == int("1" * 32, 16)
    start, end = span.start_time, span.end_time
    assert start is not None and end is not None
    assert abs(start - time.time_ns()) < 5e9  # the monotonic reading placed on the wall clock
    assert end - start == pytest.approx(2.0e9, abs=1e3)
    assert [(e.name, e.timestamp - start) for e in span.events] == [
        ("queued", 0), ("scheduled", pytest.approx(0.25e9, abs=1e3)), ("first_token", pytest.approx(0.5e9, abs=1e3)),
        ("finished", pytest.approx(2.0e9, abs=1e3))]
    attrs = dict(span.attributes or {})
    assert attrs == {
        "gen_ai.response.model": "smol", "gen_ai.request.id": "r1", "sluice.engine.request_key": "r1",
        "gen_ai.request.n": 2,
        "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9, "gen_ai.request.max_tokens": 9,
        "gen_ai.usage.prompt_tokens": 7, "gen_ai.usage.completion_tokens": 12,
        "gen_ai.response.finish_reasons": "length", "sluice.num_preemptions": 1,
        "gen_ai.latency.e2e": pytest.approx(2.0), "gen_ai.latency.time_in_queue": pytest.approx(0.25),
        "gen_ai.latency.time_to_first_token": pytest.approx(0.5),
        "gen_ai.latency.time_in_model_prefill": pytest.approx(0.25),
        "gen_ai.latency.time_in_model_decode": pytest.approx(1.5),
        "gen_ai.latency.time_in_model_inference": pytest.approx(1.75)}
    assert span.status.status_code is StatusCode.UNSET


def test_a_request_aborted_while_waiting_has_only_its_arrival_and_end() -> None:
    t = time.monotonic()
    span = _observe(EngineCoreOutput("r2", [], finish_reason=FinishReason.ABORT, request_finished=True,
                                     times=RequestTimes(t, None, None, t + 1.0)))
    assert [e.name for e in span.events] == ["queued", "finished"]
    attrs = dict(span.attributes or {})
    assert "gen_ai.latency.time_in_queue" not in attrs and "gen_ai.latency.time_to_first_token" not in attrs
    assert attrs["gen_ai.usage.completion_tokens"] == 0


def test_engine_failures_end_the_span_with_an_error() -> None:
    t = time.monotonic()
    failed = _observe(EngineCoreOutput("r3", [], finish_reason=FinishReason.ERROR, request_finished=True,
                                       times=RequestTimes(t, t, None, t + 0.1)))
    assert failed.status.status_code is StatusCode.ERROR
    untimed = _observe(EngineCoreOutput("r4", [], finish_reason=FinishReason.ERROR, request_finished=True))
    assert untimed.status.status_code is StatusCode.ERROR
    assert dict(untimed.attributes or {})["gen_ai.request.id"] == "r4"


def test_request_lines_name_the_request(caplog: pytest.LogCaptureFixture) -> None:
    observer = RequestObserver("smol", tracing=None, log_requests=True)
    t = time.monotonic()
    with caplog.at_level(logging.INFO, logger="engine.entrypoints.request_observer"):
        observer.added("r5", "r5", 7, SamplingParams(max_tokens=3))
        observer.finished(EngineCoreOutput("r5", [1], finish_reason=FinishReason.EOS, request_finished=True,
                                           times=RequestTimes(t, t, t, t, 0, 3)), "r5", {}, 7, SamplingParams())
        observer.added("tok-1", "client-7", 7, SamplingParams(max_tokens=3))   # the caller's id, and the key
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "Added request r5", "Finished request r5", "Added request client-7 (engine key tok-1)"]
    assert [getattr(r, "request_id", None) for r in caplog.records] == ["r5", "r5", "client-7"]
    assert "eos, 7 prompt tokens, 3 generated tokens" in caplog.records[1].getMessage()


def test_the_span_carries_the_callers_id_and_the_engines_key() -> None:
    t = time.monotonic()
    span = _observe(EngineCoreOutput("tok-9", [1], finish_reason=FinishReason.EOS, request_finished=True,
                                     times=RequestTimes(t, t, t, t, 0, 1)), label="client-9")
    attrs = dict(span.attributes or {})
    assert (attrs["gen_ai.request.id"], attrs["sluice.engine.request_key"]) == ("client-9", "tok-9")
