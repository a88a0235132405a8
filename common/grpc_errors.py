"""gRPC status codes for Sluice's typed errors, and the one interceptor every server installs."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from common.errors import (
    AlreadyExistsError,
    EngineDeadError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    QueueFullError,
)

logger = logging.getLogger(__name__)

# Trailing metadata of a refused call naming its typed reason (sluice.v1.ErrorReason, by value name), for the
# refusals a caller acts on: a status code alone is too coarse, and matching the details' text is not a contract.
ERROR_REASON_KEY = "sluice-error-reason"
# Trailing metadata of a RESOURCE_EXHAUSTED call: whole seconds to wait before retrying (the gateway's Retry-After).
RETRY_AFTER_KEY = "retry-after"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream call failed: pass its status through
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AlreadyExistsError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, FailedPreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or "the request queue is full"
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "the engine is not running"
    return grpc.StatusCode.INTERNAL, "internal error"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps Sluice's typed errors to gRPC status codes for every handler; nothing else leaks out."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                except Exception as e:  # noqa: BLE001 — mapped, logged when unexpected
                    await _abort_with(e, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(handler.stream_stream), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


def _streaming(inner: Callable[[Any, grpc.aio.ServicerContext], Any]) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
    """A response-streaming handler (unary or streaming request) whose errors end the call mapped: an async
    generator, or a coroutine that writes with ``context.write`` (grpc_health's ``Watch``, which the gateways'
    client-side health checking calls)."""
    if not inspect.isasyncgenfunction(inner):
        async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
            try:
                await inner(request, context)
            except Exception as e:  # noqa: BLE001
                await _abort_with(e, context)

        return writer

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in inner(request, context):
                yield item
        except Exception as e:  # noqa: BLE001
            await _abort_with(e, context)

    return handler


async def _abort_with(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    if isinstance(exc, grpc.aio.AbortError) or type(exc).__name__ == "AbortError":
        raise exc
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("unexpected error in handler", exc_info=exc)
    if (retry := retry_after_s(exc)) is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry)),))
    await context.abort(code, message)


def retry_after_s(exc: BaseException) -> int | None:
    """The seconds a refusal says to wait before retrying: an overloaded engine's estimate (QueueFullError), or a
    downstream call's ``retry-after`` trailer, passed on; None when unsaid."""
    if isinstance(exc, QueueFullError):
        return exc.retry_after_s
    if isinstance(exc, grpc.aio.AioRpcError):
        for key, value in exc.trailing_metadata() or ():
            if key == RETRY_AFTER_KEY and isinstance(value, str) and value.isdigit():
                return int(value)
    return None
