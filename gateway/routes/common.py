"""What every route needs: the app's state, the request body under a size limit."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request

from gateway.backend import Backend, ModelInfo
from gateway.errors import ApiError, BackendError, BackendErrorKind, from_backend, model_not_found
from gateway.fields import parse_json_object
from gateway.metrics import GatewayMetrics
from gateway.request_context import request_id_of
from gateway.settings import GatewaySettings

# Until the backend gives its context length (and with no --max-body-bytes), bodies are capped at this.
FALLBACK_MAX_BODY_BYTES = 32 * 1024 * 1024
# A bound on the JSON bytes one prompt token can take: a token is a few characters, and an escaped
# character takes at most 6 bytes (\uXXXX) or 12 for a surrogate pair. The tokenizer service bounds
# characters per token the same way before it tokenizes.
MAX_BODY_BYTES_PER_TOKEN = 16
# Room for everything besides the prompt: sampling fields, tools, schemas, grammars.
BODY_HEADROOM_BYTES = 1024 * 1024


def body_limit_for(max_model_len: int) -> int:
    return max_model_len * MAX_BODY_BYTES_PER_TOKEN + BODY_HEADROOM_BYTES


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
        self._max_model_len: int | None = None

    async def max_model_len(self) -> int | None:
        """The model's context length: asked once (it does not change while the backend runs);
        None while the backend cannot say."""
        if self._max_model_len is None:
            try:
                info = self._last if self._last is not None else await self.info()
            except BackendError:
                return None
            self._max_model_len = info.max_model_len or None
        return self._max_model_len

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

    async def body_limit(self) -> int:
        """``--max-body-bytes`` when given; else sized from the model's context length, so a body cannot
        carry more text than a prompt could hold; the fixed fallback until the backend says."""
        if self.settings.max_body_bytes is not None:
            return self.settings.max_body_bytes
        max_model_len = await self.models.max_model_len()
        if max_model_len is None:
            return FALLBACK_MAX_BODY_BYTES
        return body_limit_for(max_model_len)

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
    # The connection is closed: the rest of the body is not read.
    return ApiError(413, f"The request body is larger than {limit} bytes, this server's limit.",
                    code="request_too_large", headers={"Connection": "close"})


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit``: from
    Content-Length before reading anything, else while it streams in (chunked);
    408 when it has not all arrived within ``timeout`` seconds (a client trickling
    bytes holds a connection and its buffer for no longer than that)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ApiError(400, "Invalid Content-Length header.")
        if int(length) > limit:
            raise _too_large(limit)

    async def read() -> bytes:
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout:g} seconds.", code="request_timeout",
                       headers={"Connection": "close"}) from None


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").partition(";")[0].strip().lower()
    return media_type == "application/json"


async def read_json(request: Request) -> dict[str, object]:
    """The body as a JSON object. Only with a JSON content type: a web page can make a browser POST
    ``text/plain``, a form or an untyped blob to any address without asking (no CORS preflight), but
    never ``application/json`` — so a keyless server on a developer's machine cannot be driven that way."""
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        got = f"got {content_type[:64]!r}" if content_type else "got none"
        raise ApiError(415, f"The request body must be JSON, sent with `Content-Type: application/json` ({got}).",
                       code="unsupported_media_type")
    state = gateway_state(request)
    limit = await state.body_limit()
    return parse_json_object(await read_body(request, limit, state.settings.body_read_timeout))


async def resolve_model(request: Request, requested: str | None) -> ModelChoice:
    state = gateway_state(request)
    try:
        return await state.models.resolve(requested)
    except BackendError as err:
        raise state.api_error(err) from None
