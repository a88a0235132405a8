"""Outermost middleware: the request id, and the last line of defence against
an unexpected exception leaking a traceback.

``x-request-id`` is taken from the client when it is a sane token, else
generated; routes read it from ``scope["state"]["request_id"]``, pass it to the
backend as gRPC metadata, and every response echoes it. Every line logged while
the request runs carries it (``common/logs.py``); with ``log_requests``
(``--enable-log-requests``) the request's arrival and end get a line each.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.logs import request_context
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
    def __init__(self, app: ASGIApp, log_requests: bool = False) -> None:
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = pick_request_id(scope)
        scope["state"] = {**scope.get("state", {}), "request_id": request_id}
        started = False
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        with request_context(request_id):
            if self.log_requests:
                log.info("Received request %s: %s %s", request_id, scope["method"], scope["path"])
                arrival = time.monotonic()
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:
                log.exception("request %s failed", request_id)
                if not started:
                    await internal_error(request_id).response()(scope, receive, send_with_id)
            finally:
                if self.log_requests:
                    log.info("Finished request %s: status %d in %.3f s", request_id, status,
                             time.monotonic() - arrival)
