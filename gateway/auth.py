"""Bearer API-key authentication as ASGI middleware.

The decision uses the ASGI scope's ``path`` — what the router will route —
never a URL rebuilt from the Host header, which a client controls (a
``Host: x/health?`` header must not make ``/v1/completions`` public).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from common.auth import key_matches
from gateway.errors import ApiError

# Probes, Prometheus scrapers and the API's description carry no key (as in vLLM; Triton's health probes as in
# Triton); nothing here is private.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/docs", "/v2/health/live",
                          "/v2/health/ready"})


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode("utf-8") for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        # Header values are decoded as latin-1: encoding back gives the bytes the client sent.
        if token is None or not key_matches(token.encode("latin-1", "replace"), self.keys):
            message = "Missing API key: send `Authorization: Bearer <key>`." if token is None else "Invalid API key."
            err = ApiError(401, message, type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
