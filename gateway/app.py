"""The gateway's Starlette app: routes, middleware, error handlers, lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from common.tracing import Tracing
from gateway.auth import AuthMiddleware
from gateway.backend import Backend
from gateway.drain import Drain, DrainMiddleware
from gateway.errors import ApiError, api_error_handler, http_exception_handler
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.openapi import docs_routes
from gateway.request_context import RequestContextMiddleware
from gateway.responses_api.store import ResponseStore
from gateway.routes import build_routes
from gateway.routes.cache import dev_routes
from gateway.routes.common import GatewayState, ServedModels
from gateway.settings import GatewaySettings
from gateway.tracing import TracingMiddleware


def create_app(settings: GatewaySettings, backend: Backend | None = None,
               metrics: GatewayMetrics | None = None, drain: Drain | None = None,
               tracing: Tracing | None = None) -> Starlette:
    """The ASGI app. Without ``backend``, a gRPC client to ``settings.tokenizer_addresses``
    is opened at startup and closed at shutdown (the channel binds to the server's loop);
    a given backend is the caller's to close. ``drain``: the server's (``gateway/server.py``),
    which turns new requests away once SIGTERM came. ``tracing``: a span per request, its
    context sent on to the backend (None: tracing off)."""
    routes = build_routes()
    if settings.server_dev_mode:
        routes += dev_routes()
    if settings.enable_docs:
        routes += docs_routes(secured=bool(settings.api_keys))
    metrics = metrics if metrics is not None else GatewayMetrics(
        federate=settings.metrics_federate, federate_tokenizers=settings.metrics_federate_tokenizers,
        federate_kv_roles=settings.metrics_federate_kv_roles)
    # Outermost first: the request id and the catch-all see every response (401s
    # included), metrics count them, a draining server turns requests away before
    # anything else (a load balancer probes without a key), CORS answers preflights
    # before auth asks for a key.
    middleware = [Middleware(RequestContextMiddleware, log_requests=settings.log_requests)]
    if tracing is not None:
        middleware.append(Middleware(TracingMiddleware, tracing=tracing,
                                     known_paths=frozenset(r.path for r in routes)))
    middleware += [
        Middleware(MetricsMiddleware, metrics=metrics, known_paths=frozenset(r.path for r in routes)),
        Middleware(DrainMiddleware, drain=drain if drain is not None else Drain(),
                   retry_after=settings.retry_after_seconds),
    ]
    if settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                                     allow_credentials=settings.allow_credentials,
                                     allow_methods=list(settings.allowed_methods),
                                     allow_headers=list(settings.allowed_headers),
                                     expose_headers=["X-Request-Id", "Retry-After"]))
    middleware.append(Middleware(AuthMiddleware, api_keys=settings.api_keys))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if backend is not None:
            yield
            return
        from gateway.client import GrpcBackend

        grpc_backend = GrpcBackend.connect(settings.tokenizer_addresses, mux=settings.tokenizer_mux, tracing=tracing,
                                          tls=settings.grpc_tls,
                                          api_key=settings.api_keys[0] if settings.api_keys else None)
        app.state.gateway = _state(settings, grpc_backend, metrics)
        try:
            yield
        finally:
            await grpc_backend.close()

    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: http_exception_handler, ApiError: api_error_handler},
        lifespan=lifespan,
    )
    # A redirect to the slash-less path would be built from the client's Host header.
    app.router.redirect_slashes = False
    app.state.responses = ResponseStore()  # /v1/responses' previous_response_id, in this process only
    if backend is not None:
        app.state.gateway = _state(settings, backend, metrics)
    return app


def _state(settings: GatewaySettings, backend: Backend, metrics: GatewayMetrics) -> GatewayState:
    return GatewayState(settings, backend, metrics, ServedModels(settings.served_model_names, backend,
                                                                 settings.ready_timeout))
