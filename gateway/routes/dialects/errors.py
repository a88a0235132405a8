"""The gateway's one :class:`ApiError` (the OpenAI routes' status mapping) in each dialect's own error body.

* TGI, and MindIE's routes (its TGI-style and vLLM-style ``/generate`` and its own ``/infer`` share one table):
  ``{"error": message, "error_type": kind}`` with TGI's statuses — an invalid request is 422 ``validation``, a
  generation that failed 424 ``generation``, a full queue 429 ``overloaded``; the others keep their status.
* Triton's generate extension: ``{"error": message}``, the status as the OpenAI routes give it.

A request's fields are validated under the OpenAI names they map to (one validation for every route); a 400
that names such a field is renamed to the dialect's own field here, so the message names what the client sent.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import ApiError

# TGI's status for the gateway's: 400 is TGI's 422 "Input validation error", a failed generation its 424.
_TGI_STATUS = {400: 422, 500: 424}
_TGI_TYPE = {404: "not_found", 408: "timeout", 413: "validation", 415: "validation", 422: "validation",
             424: "generation", 429: "overloaded", 501: "not_implemented", 503: "unavailable", 504: "timeout"}

Handler = Callable[[Request], Awaitable[Response]]


def tgi_status(err: ApiError) -> int:
    return _TGI_STATUS.get(err.status, err.status)


def tgi_body(err: ApiError) -> dict[str, object]:
    return {"error": err.message, "error_type": _TGI_TYPE.get(tgi_status(err), "generation")}


def tgi_response(err: ApiError) -> Response:
    return JSONResponse(tgi_body(err), status_code=tgi_status(err), headers=err.headers)


def triton_body(err: ApiError) -> dict[str, object]:
    return {"error": err.message}


def triton_response(err: ApiError) -> Response:
    return JSONResponse(triton_body(err), status_code=err.status, headers=err.headers)


def answering(render: Callable[[ApiError], Response]) -> Callable[[Handler], Handler]:
    """A route whose errors (body limits, JSON, validation, the backend's) come back in ``render``'s shape."""
    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as err:
                return render(err)
        return route
    return wrap


def renamed(err: ApiError, names: Mapping[str, str]) -> ApiError:
    """``err`` naming the dialect's field where it names an OpenAI field that one maps to."""
    name = names.get(err.param) if err.param is not None else None
    if name is None:
        return err
    err.message = err.message.replace(f"`{err.param}`", f"`{name}`")
    err.param = name
    return err
