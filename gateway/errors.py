"""OpenAI error bodies, and how each failure maps onto an HTTP status.

Every error the gateway returns is ``{"error": {"message", "type", "param",
"code"}}``. Messages are written here or taken from a client-facing validation
message; backend transport details (addresses, gRPC debug strings) and
tracebacks never reach a body.
"""

from __future__ import annotations

import enum
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger("gateway")

# Messages from the backend are shown to clients only for INVALID_ARGUMENT-like
# failures, and are capped so a misbehaving backend cannot echo a whole prompt.
_MAX_BACKEND_MESSAGE = 500


class BackendErrorKind(enum.Enum):
    """Why a backend call failed, independent of the transport (gRPC codes)."""

    INVALID_ARGUMENT = "invalid_argument"
    FAILED_PRECONDITION = "failed_precondition"  # the backend is not set up for this (runtime LoRA updating off)
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"


class BackendError(Exception):
    """A backend call failed. ``message`` is the backend's own text, for logs and
    (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, ALREADY_EXISTS only) for the client."""

    def __init__(self, kind: BackendErrorKind, message: str = "", retry_after: int | None = None) -> None:
        super().__init__(f"{kind.value}: {message}")
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


class ApiError(Exception):
    """An error to return to the HTTP client as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", type="not_found_error", param="model",
                    code="model_not_found")


def internal_error(request_id: str | None = None) -> ApiError:
    suffix = f" (request id {request_id})" if request_id else ""
    return ApiError(500, f"The server had an error while processing the request{suffix}.", type="server_error",
                    code="internal_error")


def _split_field(message: str) -> tuple[str | None, str]:
    """The backend writes validation errors as ``"field: message"``; pick the field out."""
    head, sep, _ = message.partition(": ")
    if sep and head and all(c.isalnum() or c in "_.[]" for c in head):
        return head, message
    return None, message


def from_backend(err: BackendError, retry_after_default: int) -> ApiError:
    """Map a backend failure onto the client-facing error, without transport details."""
    kind = err.kind
    if kind in (BackendErrorKind.INVALID_ARGUMENT, BackendErrorKind.FAILED_PRECONDITION,
                BackendErrorKind.ALREADY_EXISTS):
        param, message = _split_field(err.message[:_MAX_BACKEND_MESSAGE] or "Invalid request.")
        return ApiError(400, message, param=param)
    if kind is BackendErrorKind.NOT_FOUND:
        return ApiError(404, err.message[:_MAX_BACKEND_MESSAGE] or "Not found.", type="not_found_error",
                        code="not_found")
    if kind is BackendErrorKind.RESOURCE_EXHAUSTED:
        retry_after = err.retry_after if err.retry_after is not None else retry_after_default
        why = err.message[:_MAX_BACKEND_MESSAGE].rstrip(".") or "its request queue is full"  # the engine's reason
        return ApiError(429, f"The server is busy: {why}. Retry later.", type="rate_limit_error",
                        code="queue_full", headers={"Retry-After": str(retry_after)})
    if kind is BackendErrorKind.UNAVAILABLE:
        return ApiError(503, "The model backend is unavailable. Retry later.", type="service_unavailable_error",
                        code="backend_unavailable", headers={"Retry-After": str(retry_after_default)})
    if kind is BackendErrorKind.DEADLINE_EXCEEDED:
        return ApiError(504, "The request timed out.", type="timeout_error", code="timeout")
    if kind is BackendErrorKind.UNIMPLEMENTED:
        return ApiError(501, "This operation is not supported by the model backend.", type="server_error",
                        code="not_implemented")
    return internal_error()


_HTTP_CODES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (404 unknown route, 405 wrong method) as OpenAI bodies."""
    assert isinstance(exc, HTTPException)
    type_, code = _HTTP_CODES.get(exc.status_code, ("invalid_request_error", None))
    path = str(request.scope.get("path", ""))[:200]  # the ASGI path, never a URL rebuilt from Host
    if exc.status_code == 404:
        message = f"Route {request.method} {path} not found."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {path}."
    else:
        message = str(exc.detail)
    err = ApiError(exc.status_code, message, type=type_, code=code, headers=dict(exc.headers or {}))
    return err.response()


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()
