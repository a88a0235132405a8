"""Tracing and logs end to end: `sluice serve --otlp-traces-endpoint` against an OTLP collector served in the test
(the opentelemetry-proto gRPC TraceService on 127.0.0.1), the official openai SDK as the client, and
`--log-format json --enable-log-requests` checked on the lines the children really print."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import grpc
import openai
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from common.procs import free_port
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.e2e.otlp_collector import Collector, Span
from tests.procs import ServeStack, spawn, stop, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def collector(otlp_collector: tuple[Collector, str]) -> tuple[Collector, str]:
    return otlp_collector


@pytest.fixture(scope="module")
def stack(traced_stack: ServeStack) -> ServeStack:
    """tests/e2e/conftest.py: the request-API tests' stack, which exports to ``collector`` and logs JSON lines."""
    return traced_stack


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(base_url: str, request_id: str, **headers: str) -> openai.types.chat.ChatCompletion:
    client = _client(base_url)
    return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hello."}],
                                          extra_headers={"x-request-id": request_id, **headers})


def _check_chain(collector: Collector, request_id: str, usage: openai.types.CompletionUsage) -> list[Span]:
    """The request's three spans form one trace, gateway -> tokenizer -> engine; returns them in that order."""
    spans = collector.wait_for(3, **{"gen_ai.request.id": request_id})
    by_service = {s.service: s for s in spans}
    assert sorted(by_service) == ["sluice-engine", "sluice-gateway", "sluice-tokenizer"], spans
    assert len(spans) == 3
    gateway, tokenizer, engine = (by_service[f"sluice-{p}"] for p in ("gateway", "tokenizer", "engine"))
    assert {s.trace_id for s in spans} == {gateway.trace_id}
    assert len(collector.trace(gateway.trace_id)) == 3  # nothing else joined the trace
    assert tokenizer.parent_id == gateway.span_id
    assert engine.parent_id == tokenizer.span_id

    assert gateway.span.name == "POST /v1/chat/completions"
    assert gateway.span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert gateway.attributes["http.response.status_code"] == 200
    assert gateway.attributes["http.route"] == "/v1/chat/completions"
    assert tokenizer.span.name == "sluice.v1.Generation/Generate"
    assert {"prompt_ready", "first_response"} <= set(tokenizer.events)

    attrs, events = engine.attributes, engine.events
    assert engine.span.name == "llm_request"
    assert attrs["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.n"] == 1
    assert list(events) == ["queued", "scheduled", "first_token", "finished"]
    # Events at the engine's recorded times, inside the span, which lies inside its parents'.
    start, end = engine.span.start_time_unix_nano, engine.span.end_time_unix_nano
    assert start == events["queued"] <= events["scheduled"] <= events["first_token"] <= events["finished"] == end
    assert attrs["gen_ai.latency.e2e"] == pytest.approx((end - start) / 1e9, abs=1e-6)
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx((events["scheduled"] - start) / 1e9, abs=1e-6)
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx((events["first_token"] - start) / 1e9,
                                                                          abs=1e-6)
    for outer, inner in ((gateway, tokenizer), (tokenizer, engine)):
        assert outer.span.start_time_unix_nano <= inner.span.start_time_unix_nano
        assert inner.span.end_time_unix_nano <= outer.span.end_time_unix_nano
    return [gateway, tokenizer, engine]


def test_one_chat_request_is_one_trace_gateway_tokenizer_engine(stack: ServeStack,
                                                                collector: tuple[Collector, str]) -> None:
    """`sluice serve` multiplexes the gateway's requests on GenerateStream (and the tokenizer's on Engine.Stream):
    the context rides in each request's trace_headers."""
    response = _chat(stack.base_url, "trace-mux-1")
    assert response.usage is not None and response.usage.completion_tokens > 0
    gateway, _, _ = _check_chain(collector[0], "trace-mux-1", response.usage)
    assert gateway.parent_id == ""  # the client sent no context: a root span


def test_client_traceparent_makes_the_gateway_span_its_child(stack: ServeStack,
                                                             collector: tuple[Collector, str]) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = _chat(stack.base_url, "trace-parent-1", traceparent=f"00-{trace_id}-{parent_id}-01")
    assert response.usage is not None
    gateway, _, _ = _check_chain(collector[0], "trace-parent-1", response.usage)
    assert gateway.trace_id == trace_id
    assert gateway.parent_id == parent_id


def test_per_request_generate_calls_carry_the_context(stack: ServeStack, collector: tuple[Collector, str],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway without --tokenizer-mux (a Generate call per request) against the same tokenizer service. Its
    batches would leave only after 10 minutes: its span arrives because shutting down exports what is queued."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    port = free_port()
    proc = spawn(["-m", "gateway", "--tokenizer", f"127.0.0.1:{stack.tokenizer_port}", "--port", str(port),
                  "--otlp-traces-endpoint", collector[1]], tmp_path / "gateway.log")
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(base_url), 60, proc, "gateway ready")
        response = _chat(base_url, "trace-unary-1")
        assert response.usage is not None
        collector[0].wait_for(2, **{"gen_ai.request.id": "trace-unary-1"})  # the tokenizer's and the engine's
        assert not any(s.service == "sluice-gateway" for s in collector[0].trace(
            collector[0].wait_for(2, **{"gen_ai.request.id": "trace-unary-1"})[0].trace_id))
    finally:
        assert stop(proc) == 0  # SIGTERM: drained, then the span exported
    _check_chain(collector[0], "trace-unary-1", response.usage)


def _ready(base_url: str) -> bool:
    from tests.procs import http_status

    return http_status(f"{base_url}/ready") == 200


def test_a_grpc_clients_traceparent_metadata_parents_the_tokenizer_span(stack: ServeStack,
                                                                        collector: tuple[Collector, str]) -> None:
    """The public gRPC API: a Generate call without trace_headers continues its metadata's traceparent."""
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    with grpc.insecure_channel(f"127.0.0.1:{stack.tokenizer_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(request_id="trace-grpc-1", text="Hello")
        request.stopping.max_tokens = 4
        list(stub.Generate(request, timeout=60, metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),)))
    spans = collector[0].wait_for(2, **{"gen_ai.request.id": "trace-grpc-1"})
    tokenizer = next(s for s in spans if s.service == "sluice-tokenizer")
    engine = next(s for s in spans if s.service == "sluice-engine")
    assert (tokenizer.trace_id, tokenizer.parent_id) == (trace_id, parent_id)
    assert (engine.trace_id, engine.parent_id) == (trace_id, tokenizer.span_id)


def test_the_engines_generate_call_continues_trace_headers(stack: ServeStack,
                                                           collector: tuple[Collector, str]) -> None:
    """The engine's per-request Generate RPC (the Stream's fallback) makes the same span."""
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    request = engine_pb2.EngineGenerateRequest(request_id="trace-engine-1",
                                               trace_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    request.prompt_token_ids.ids.extend([1, 2, 3, 4, 5])
    request.stopping.max_tokens = 3
    request.stopping.ignore_eos = True
    with grpc.insecure_channel(stack.engine_addr) as channel:
        outputs = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
    assert sum(len(o.token_ids) for o in outputs) == 3
    (engine,) = collector[0].wait_for(1, **{"gen_ai.request.id": "trace-engine-1"})
    assert (engine.trace_id, engine.parent_id) == (trace_id, parent_id)
    assert engine.attributes["gen_ai.usage.prompt_tokens"] == 5
    assert engine.attributes["gen_ai.usage.completion_tokens"] == 3


def test_every_line_the_children_print_is_json_with_the_request_id(stack: ServeStack,
                                                                   collector: tuple[Collector, str]) -> None:
    _chat(stack.base_url, "logs-1")
    collector[0].wait_for(3, **{"gen_ai.request.id": "logs-1"})  # the request is over everywhere
    lines = [line for line in stack.log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # a line that is not JSON fails here
    assert len(records) > 10
    for record in records:
        assert {"time", "level", "logger", "message", "process"} <= record.keys(), record
    processes = {r["process"] for r in records}
    assert {"serve", "engine", "tokenizer", "gateway"} <= processes
    mine = [r for r in records if r.get("request_id") == "logs-1"]
    messages = {(r["process"], r["message"].split(" ", 2)[0] + " " + r["message"].split(" ", 2)[1]) for r in mine}
    # vLLM's request lines (--enable-log-requests), from the gateway and from the engine.
    assert {("gateway", "Received request"), ("gateway", "Finished request"), ("engine", "Added request"),
            ("engine", "Finished request")} <= messages
    # Lines of no request carry no id (start-up, the supervisor's own).
    assert all("request_id" not in r for r in records if r["process"] == "serve")
