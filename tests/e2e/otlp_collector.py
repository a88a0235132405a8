"""An OTLP/gRPC trace collector served on 127.0.0.1 (the opentelemetry-proto TraceService) keeping every span it
is sent, for the end-to-end tracing tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class Span:
    service: str
    span: trace_pb2.Span

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, Any]:
        return {kv.key: _value(kv.value) for kv in self.span.attributes}

    @property
    def events(self) -> dict[str, int]:
        return {e.name: e.time_unix_nano for e in self.span.events}


def _value(v: common_pb2.AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value"))


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for rs in request.resource_spans:
                service = next(_value(kv.value) for kv in rs.resource.attributes if kv.key == "service.name")
                self.spans += [Span(service, s) for ss in rs.scope_spans for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, count: int, **attributes: Any) -> list[Span]:
        """The spans whose attributes include ``attributes``, once there are ``count`` (or after 20 s)."""
        found: list[Span] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with self._lock:
                found = [s for s in self.spans if attributes.items() <= s.attributes.items()]
            if len(found) >= count:
                time.sleep(0.3)  # a span too many would come in the same batches
                with self._lock:
                    return [s for s in self.spans if attributes.items() <= s.attributes.items()]
            time.sleep(0.1)
        return found

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@contextmanager
def serve_collector() -> Iterator[tuple[Collector, str]]:
    """A collector and the endpoint (``http://127.0.0.1:port``) its server listens on."""
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)
