"""Requests whose bytes do not parse (invalid UTF-8 in a proto3 ``string`` field, a truncated message) refused as
INVALID_ARGUMENT naming the field, instead of grpc's UNKNOWN and an ERROR traceback: grpc calls the request
deserializer before any handler or interceptor code runs, and protobuf raises ``DecodeError`` there without
saying which field. The deserializer installed here keeps the raw bytes of a request that does not parse; the
handler it wraps then raises ``InvalidRequestError`` with the field found by walking the wire format against
the message's descriptor (the error interceptor maps it)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from common.errors import InvalidRequestError

_MAX_DEPTH = 32


@dataclass(frozen=True)
class _Undecodable:
    """What the lenient deserializer returns for bytes that do not parse."""

    raw: bytes
    descriptor: Descriptor | None

    def error(self) -> InvalidRequestError:
        if self.descriptor is None:
            return InvalidRequestError("request", "the request message could not be parsed")
        field = invalid_utf8_field(self.raw, self.descriptor)
        if field is not None:
            return InvalidRequestError(field, f"is not valid UTF-8 (a string field of {self.descriptor.full_name})")
        return InvalidRequestError("request", f"is not a valid {self.descriptor.full_name} message")


def invalid_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "", depth: int = 0) -> str | None:
    """The dotted path of the first ``string`` field (nested messages, repeated and map entries included) whose
    bytes are not UTF-8, or None (none is, or the bytes are not a well-formed message)."""
    pos, end = 0, len(data)
    try:
        while pos < end:
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
                    found = invalid_utf8_field(chunk, field.message_type, name + ".", depth + 1)
                    if found is not None:
                        return found
            else:  # groups (proto2 only) or garbage
                return None
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    message_class = getattr(deserializer, "__self__", None)  # generated stubs pass ``Message.FromString``
    descriptor = getattr(message_class, "DESCRIPTOR", None)

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError:
            return _Undecodable(raw, descriptor if isinstance(descriptor, Descriptor) else None)

    return deserialize


def _checked_unary(inner: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: Any) -> Any:
        if isinstance(request, _Undecodable):
            raise request.error()
        return await inner(request, context)

    return handler


def _checked_stream(inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    if not inspect.isasyncgenfunction(inner):
        return _checked_unary(inner)

    async def handler(request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, _Undecodable):
            raise request.error()
        async for item in inner(request, context):
            yield item

    return handler


async def _checked_requests(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A streamed call's requests, raising at the first that does not parse: the handler's reader ends the
    call with INVALID_ARGUMENT naming the field (``GenerateStream``: as a second ``generate`` for an open id
    does; the call's open requests are aborted)."""
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.error()
        yield request


def _checked_request_stream(inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    if inspect.isasyncgenfunction(inner):
        async def streaming(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for item in inner(_checked_requests(requests), context):
                yield item

        return streaming

    async def unary(requests: AsyncIterator[Any], context: Any) -> Any:
        return await inner(_checked_requests(requests), context)

    return unary


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """For every method: a request that does not parse is refused as INVALID_ARGUMENT naming its field (on a
    request-streaming call, the first such message ends the call so). Installed inside the error interceptor,
    which maps the ``InvalidRequestError`` raised."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return handler
        deserialize = _lenient(handler.request_deserializer)
        if handler.request_streaming:
            if handler.stream_stream is not None:
                return grpc.stream_stream_rpc_method_handler(
                    _checked_request_stream(handler.stream_stream), request_deserializer=deserialize,
                    response_serializer=handler.response_serializer)
            if handler.stream_unary is not None:
                return grpc.stream_unary_rpc_method_handler(
                    _checked_request_stream(handler.stream_unary), request_deserializer=deserialize,
                    response_serializer=handler.response_serializer)
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _checked_unary(handler.unary_unary), request_deserializer=deserialize,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _checked_stream(handler.unary_stream), request_deserializer=deserialize,
                response_serializer=handler.response_serializer)
        return handler
