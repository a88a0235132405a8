"""OpenTelemetry tracing, on only when an OTLP endpoint is configured (``--otlp-traces-endpoint``, vLLM's flag,
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).

Each process builds one :class:`Tracing` at start-up with :func:`init_tracing` (None when tracing is off) and
passes it to what makes spans; everything else checks for None and does nothing more. ``opentelemetry`` is
imported here, inside :func:`init_tracing`, and by nothing that runs with tracing off: a process started without
an endpoint never loads it.

A request's context crosses every hop as W3C Trace Context headers (``traceparent``, ``tracestate``) in a plain
``dict[str, str]`` carrier: the ``trace_headers`` map of ``GenerateRequest`` and ``EngineGenerateRequest`` (a
request's own field, because a multiplexed stream's gRPC metadata is shared by all of its requests).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind, Tracer

logger = logging.getLogger(__name__)

ENV_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
# The exporter's own switches for plaintext; when neither is set, plaintext unless the endpoint is https.
_ENV_INSECURE = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
TRACE_HEADERS = ("traceparent", "tracestate")


def traces_endpoint(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The OTLP/gRPC endpoint traces go to: the flag, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; None: off."""
    return flag or environ.get(ENV_TRACES_ENDPOINT) or None


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C Trace Context entries of a header or metadata mapping (lower-case names)."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as Unix-epoch nanoseconds (what span timestamps are)."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


class Tracing:
    """A process's tracer and the propagation of its context; built by :func:`init_tracing`."""

    def __init__(self, provider: TracerProvider, tracer: Tracer) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self.tracer = tracer
        self._propagator = TraceContextTextMapPropagator()
        self._context = context
        self._trace = trace
        self.server_kind: SpanKind = SpanKind.SERVER
        self.error_status = Status(StatusCode.ERROR)

    def extract(self, carrier: Mapping[str, str]) -> Context:
        """The context a W3C carrier names (an empty one, for a root span, when it names none)."""
        return self._propagator.extract(carrier)

    def inject(self, span: Span, carrier: MutableMapping[str, str]) -> None:
        """Write ``span`` as the parent into a W3C carrier (e.g. a request's ``trace_headers``)."""
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))

    def inject_current(self, carrier: MutableMapping[str, str]) -> None:
        """Write the calling task's current span (if any) into a W3C carrier."""
        self._propagator.inject(carrier)

    def start_span(self, name: str, *, parent: Mapping[str, str] | None = None, start_time_ns: int | None = None,
                   attributes: Mapping[str, Any] | None = None) -> Span:
        """A SERVER span, child of the span a W3C carrier names (none, or an empty carrier: a root span), not
        made current: callers that need it current attach it with :meth:`attach`."""
        return self.tracer.start_span(name, context=self.extract(parent or {}), kind=self.server_kind,
                                      start_time=start_time_ns, attributes=attributes)

    def attach(self, span: Span) -> object:
        """Make ``span`` the current one of this task; returns the token for :meth:`detach`."""
        return self._context.attach(self._trace.set_span_in_context(span))

    def detach(self, token: object) -> None:
        self._context.detach(token)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Export what is still queued and stop (each process's shutdown path calls this once)."""
        self._provider.shutdown()


def init_tracing(endpoint: str | None, service_name: str, environ: Mapping[str, str] | None = None
                 ) -> Tracing | None:
    """Set up OpenTelemetry for this process: a TracerProvider exporting over OTLP/gRPC to ``endpoint`` through a
    BatchSpanProcessor (``OTEL_BSP_*`` tune it); None, importing nothing, when ``endpoint`` is None.
    ``service_name`` unless ``OTEL_SERVICE_NAME`` is set. Plaintext unless the endpoint is ``https://`` (as vLLM),
    or as ``OTEL_EXPORTER_OTLP_[TRACES_]INSECURE`` says."""
    if endpoint is None:
        return None
    env = os.environ if environ is None else environ
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    insecure = None if any(name in env for name in _ENV_INSECURE) else not endpoint.startswith("https://")
    resource = Resource.create({SERVICE_NAME: env.get(ENV_SERVICE_NAME) or service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    trace.set_tracer_provider(provider)
    logger.info("tracing: spans of %s go to %s", resource.attributes[SERVICE_NAME], endpoint)
    return Tracing(provider, provider.get_tracer("sluice"))
