"""A SERVER span per HTTP request, when tracing is on (``--otlp-traces-endpoint``; ``common/tracing.py``).

The span continues the client's ``traceparent`` / ``tracestate`` headers when it sent them, and is the current
span while the request runs, so the backend client (``gateway/client.py``) injects it into the request's
``trace_headers``: the tokenizer service's span and the engine's become its children. It is only installed with
tracing on; without, nothing of this runs.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.tracing import TRACE_HEADERS, Tracing
from gateway.request_context import request_id_of

_TRACE_HEADER_BYTES = tuple(name.encode() for name in TRACE_HEADERS)


class TracingMiddleware:
    """Inside the request-id middleware (the id is an attribute); ``known_paths``: the routes, whose paths name
    spans (any other path is named by its method alone, so scans do not make a span name per URL)."""

    def __init__(self, app: ASGIApp, tracing: Tracing, known_paths: frozenset[str]) -> None:
        self.app = app
        self._tracing = tracing
        self._known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {name.decode(): bytes(value).decode("latin-1") for name, value in scope["headers"]
                   if name in _TRACE_HEADER_BYTES}
        method, path = scope["method"], scope["path"]
        route = path if path in self._known_paths else None
        attributes: dict[str, str | int] = {"http.request.method": method, "url.path": path,
                                            "url.scheme": scope.get("scheme", "http"),
                                            "gen_ai.request.id": request_id_of(scope)}
        if route is not None:
            attributes["http.route"] = route
        if (server := scope.get("server")) is not None and server[1] is not None:
            attributes["server.port"] = server[1]
        tracing = self._tracing
        span = tracing.start_span(f"{method} {route}" if route else method, parent=carrier, attributes=attributes)

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(tracing.error_status)
            await send(message)

        token = tracing.attach(span)
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as err:
            span.record_exception(err)
            span.set_status(tracing.error_status)
            raise
        finally:
            tracing.detach(token)
            span.end()
