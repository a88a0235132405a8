"""What every route needs: the app's state, the request body under a size limit."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from gateway.backend import Backend
from gateway.errors import ApiError, BackendError, from_backend, model_not_found
from gateway.fields import parse_json_object
from gateway.metrics import GatewayMetrics
from gateway.request_context import request_id_of
from gateway.settings import GatewaySettings


class ServedModels:
    """The model names this gateway answers to: ``--served-model-name``, else the
    name the backend reports (asked once, then kept: it does not change)."""

    def __init__(self, configured: tuple[str, ...], backend: Backend, timeout: float) -> None:
        self._names = configured
        self._backend = backend
        self._timeout = timeout

    async def names(self) -> tuple[str, ...]:
        if not self._names:
            info = await self._backend.model_info(timeout=self._timeout)
            self._names = (info.model_name,)
        return self._names

    async def resolve(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this gateway does not serve."""
        names = await self.names()
        if requested is None or requested == "":
            return names[0]
        if requested not in names:
            raise model_not_found(requested[:200])
        return requested


@dataclass(frozen=True)
class GatewayState:
    settings: GatewaySettings
    backend: Backend
    metrics: GatewayMetrics
    models: ServedModels

    def api_error(self, err: BackendError) -> ApiError:
        return from_backend(err, self.settings.retry_after_seconds)


def gateway_state(request: Request) -> GatewayState:
    state = request.app.state.gateway
    assert isinstance(state, GatewayState)
    return state


def request_id(request: Request) -> str:
    return request_id_of(request.scope)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit``: from
    Content-Length before reading anything, else while it streams in (chunked)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, "Invalid Content-Length header.")
        if int(length) > limit:
            raise _too_large(limit)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request) -> dict[str, object]:
    state = gateway_state(request)
    return parse_json_object(await read_body(request, state.settings.max_body_bytes))


async def resolve_model(request: Request, requested: str | None) -> str:
    state = gateway_state(request)
    try:
        return await state.models.resolve(requested)
    except BackendError as err:
        raise state.api_error(err) from None
