"""Graceful drain: after SIGTERM the listener stays open and new requests get 503 + ``Retry-After``
(a load balancer's "go elsewhere", where a closed port reads as an error) while the requests in flight,
streams included, finish; ``gateway/server.py`` closes the listener once none is left or the
shutdown timeout has passed."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ApiError

# Still answered normally while draining: liveness (the process is fine) and metrics.
_UNAFFECTED = frozenset({"/health", "/metrics"})


class Drain:
    """Whether this gateway is draining, and how many requests it is still serving."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin(self, timeout: float) -> bool:
        """Start draining, giving in-flight requests ``timeout`` seconds; False if it had begun already."""
        if self._deadline is not None:
            return False
        self._deadline = time.monotonic() + timeout
        return True

    def finished(self) -> bool:
        """Draining, and nothing is left to wait for (or the time is up)."""
        return self._deadline is not None and (self.in_flight == 0 or time.monotonic() >= self._deadline)


class DrainMiddleware:
    def __init__(self, app: ASGIApp, drain: Drain, retry_after: int) -> None:
        self.app = app
        self.drain = drain
        self.retry_after = retry_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNAFFECTED:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            # Connection: close sends a keep-alive client to another server for its next request.
            err = ApiError(503, "The server is shutting down. Retry on another server.",
                           type="service_unavailable_error", code="shutting_down",
                           headers={"Retry-After": str(self.retry_after), "Connection": "close"})
            await err.response()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
