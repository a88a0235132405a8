"""Outermost middleware: the request id, and the last line of defence against
an unexpected exception leaking a traceback.

``x-request-id`` is taken from the client when it is a sane token, else
generated; routes read it from ``scope["state"]["request_id"]``, pass it to the
backend as gRPC metadata, and every response echoes it.
"""

from __future__ import annotations

import logging
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import internal_error

log = logging.getLogger("gateway")

# gRPC metadata values must be printable ASCII; this is also safe in logs and ids.
_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def pick_request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            candidate = bytes(value).decode("latin-1")
            if _VALID_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


def request_id_of(scope: Scope) -> str:
    return str(scope["state"]["request_id"])


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = pick_request_id(scope)
        scope["state"] = {**scope.get("state", {}), "request_id": request_id}
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s failed", request_id)
            if not started:
                await internal_error(request_id).response()(scope, receive, send_with_id)
