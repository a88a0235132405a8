"""What every route needs: the app's state, the request body under a size limit."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from gateway.backend import Backend, ModelInfo
from gateway.errors import ApiError, BackendError, BackendErrorKind, from_backend, model_not_found
from gateway.fields import parse_json_object
from gateway.metrics import GatewayMetrics
from gateway.request_context import request_id_of
from gateway.settings import GatewaySettings


@dataclass(frozen=True)
class ModelChoice:
    """What a request's ``model`` names."""

    name: str  # the name to answer with and to label metrics with: a served model's, or the adapter's
    adapter: str = ""  # the LoRA adapter to run the request through; "" for the base model


class ServedModels:
    """The model names this gateway answers to: ``--served-model-name``, else the
    name the backend reports (asked once, then kept: it does not change), and the
    backend's LoRA adapters (they change at runtime: the backend's last answer is
    kept and asked again when a name is not in it)."""

    def __init__(self, configured: tuple[str, ...], backend: Backend, timeout: float) -> None:
        self._names = configured
        self._backend = backend
        self._timeout = timeout
        self._last: ModelInfo | None = None

    async def names(self) -> tuple[str, ...]:
        if not self._names:
            self._names = ((await self.info()).model_name,)
        return self._names

    async def info(self, timeout: float | None = None) -> ModelInfo:
        """The backend's model info, asked now (within ``timeout``, else this list's own)."""
        self._last = await self._backend.model_info(timeout=self._timeout if timeout is None else timeout)
        return self._last

    def adapters_changed(self) -> None:
        """An adapter was loaded or unloaded here: the next name not served asks the backend again."""
        if self._last is not None and self._last.lora_enabled:
            self._last = None

    async def resolve(self, requested: str | None) -> ModelChoice:
        """The model to answer with; 404 for a name that is neither a served model nor
        one of the backend's adapters. With LoRA off that is known without asking again:
        the backend's flag does not change while it runs."""
        names = await self.names()
        if requested is None or requested == "":
            return ModelChoice(names[0])
        if requested in names:
            return ModelChoice(requested)
        info = self._last
        if info is None or (info.lora_enabled and not _lists(info, requested)):
            info = await self.info()
        if info.lora_enabled and _lists(info, requested):
            return ModelChoice(requested, adapter=requested)
        raise model_not_found(requested[:200])


def _lists(info: ModelInfo, adapter: str) -> bool:
    return any(a.name == adapter for a in info.lora_adapters)


@dataclass(frozen=True)
class GatewayState:
    settings: GatewaySettings
    backend: Backend
    metrics: GatewayMetrics
    models: ServedModels

    def api_error(self, err: BackendError, model: ModelChoice | None = None) -> ApiError:
        """The client's error for ``err``; a request through an adapter that the backend does not know
        (unloaded since the gateway last asked) is the model's 404, as for any unknown model."""
        if model is not None and model.adapter and err.kind is BackendErrorKind.NOT_FOUND:
            return model_not_found(model.name[:200])
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


async def resolve_model(request: Request, requested: str | None) -> ModelChoice:
    state = gateway_state(request)
    try:
        return await state.models.resolve(requested)
    except BackendError as err:
        raise state.api_error(err) from None
