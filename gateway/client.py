"""The gRPC client to the tokenizer services' ``sluice.v1.Generation`` API.

With ``gateway/convert.py``, the only module of the gateway that touches protobuf
messages: it sends the gateway's types (``gateway/backend.py``) as requests, reads
responses back, and turns gRPC status codes into :class:`BackendError`. One ``grpc.aio`` channel balances calls
over every tokenizer service with gRPC's own ``round_robin`` policy.

Generation is a ``Generate`` call per request, or, with ``mux`` (``--tokenizer-mux``,
what ``sluice serve`` uses), requests multiplexed on one ``GenerateStream`` per
tokenizer address: the deltas of one engine step then arrive as one message for
all of that tokenizer's requests instead of one message per request.

Tokenizer services whose engine is down report NOT_SERVING, and gRPC's health checking
(``gateway/targets.py``) takes them out of the rotation; a request that still fails
UNAVAILABLE before its first delta (it raced the news) moves to another service
(:class:`FailoverCall`). So with several model replicas behind the gateway, one
replica going down fails only the requests it was running.

With tracing on, each generation carries the current span's context (the request's
span, ``gateway/tracing.py``) in ``GenerateRequest.trace_headers``, on either path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import bearer_metadata
from common.stream_mux import MuxClient, MuxRequest
from common.tls import GrpcTls, aio_channel
from common.tracing import Tracing
from gateway.backend import Delta, GenerateCall, GenerationParams, LoRAAdapter, ModelInfo, Prompt, TokenizeResult
from gateway.convert import (
    adapter_from_pb,
    chat_to_pb,
    delta_from_pb,
    generate_request_to_pb,
    model_info_from_pb,
)
from gateway.errors import BackendError, BackendErrorKind
from gateway.pooling_schemas import Classifications, Embeddings, PoolingInput, PoolingOptions, Scores
from gateway.targets import channel_options, grpc_target, tls_authority
from proto.sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# Where they were first: tests and tools import them from here.
__all__ = ["GrpcBackend", "delta_from_pb", "generate_request_to_pb", "grpc_target", "to_backend_error"]

log = logging.getLogger("gateway")

# gRPC call metadata, as grpc.aio takes it.
Metadata = tuple[tuple[str, str], ...]

HEALTH_SERVICE = "sluice.v1.Generation"

_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: BackendErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION: BackendErrorKind.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE: BackendErrorKind.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND: BackendErrorKind.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: BackendErrorKind.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BackendErrorKind.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: BackendErrorKind.UNAVAILABLE,
    # The backend cancelling on its own means it is shutting down.
    grpc.StatusCode.CANCELLED: BackendErrorKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: BackendErrorKind.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED: BackendErrorKind.UNIMPLEMENTED,
}


def to_backend_error(err: grpc.aio.AioRpcError) -> BackendError:
    kind = _CODES.get(err.code(), BackendErrorKind.INTERNAL)
    retry_after = None
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after" and isinstance(value, str) and value.isdigit():
            retry_after = int(value)
    return BackendError(kind, err.details() or "", retry_after)


class GrpcGenerateCall:
    """A running ``Generate`` call; ``cancel()`` cancels the RPC (the backend aborts)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for msg in self._call:
                yield delta_from_pb(msg)
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None

    def cancel(self) -> None:
        self._call.cancel()


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
_OK = grpc.StatusCode.OK.value[0]
_StreamEntry = tuple[int, generation_pb2.GenerateResponse | None, bool, BackendError | None]


def _status_error(item: generation_pb2.GenerateStreamItem) -> BackendError:
    """What ends a GenerateStream request with a status other than OK, as :func:`to_backend_error`."""
    code = _STATUS_BY_NUMBER.get(item.status_code, grpc.StatusCode.UNKNOWN)
    return BackendError(_CODES.get(code, BackendErrorKind.INTERNAL), item.status_message,
                        item.retry_after_seconds or None)


class _GenerateStreamProtocol:
    """``GenerateStream`` for :class:`common.stream_mux.MuxClient`: items by id, ``cancel`` to abort."""

    def entries(self, message: generation_pb2.GenerateStreamResponse) -> Iterator[_StreamEntry]:
        for item in message.items:
            error = _status_error(item) if item.end and item.status_code != _OK else None
            yield item.id, item.response if item.HasField("response") else None, item.end, error

    def abort(self, key: int) -> generation_pb2.GenerateStreamRequest:
        return generation_pb2.GenerateStreamRequest(id=key, cancel=True)

    def call_error(self, cause: BaseException | None) -> BackendError:
        # Whatever ended the stream, the requests it carried did not cause it: they fail as unavailable.
        if cause is None:
            reason = "the tokenizer service ended the stream"
        elif isinstance(cause, grpc.aio.AioRpcError):
            reason = f"the tokenizer stream failed: {cause.code().name}: {cause.details() or ''}"
        elif isinstance(cause, asyncio.CancelledError):
            reason = "the gateway is shutting down"
        else:
            reason = "the tokenizer stream failed"
        return BackendError(BackendErrorKind.UNAVAILABLE, reason)

    def deadline_error(self) -> BackendError:
        return BackendError(BackendErrorKind.DEADLINE_EXCEEDED, "deadline exceeded")


class MuxGenerateCall:
    """One request on a :class:`GenerateStream`; ``cancel()`` sends the stream a cancel for it."""

    def __init__(self, request: MuxRequest[generation_pb2.GenerateResponse]) -> None:
        self._request = request

    async def __aiter__(self) -> AsyncIterator[Delta]:
        async for response in self._request:
            yield delta_from_pb(response)

    def cancel(self) -> None:
        self._request.cancel()


class GenerateStream:
    """Requests multiplexed on ``GenerateStream`` calls to one tokenizer service: one call at a time,
    opened on the first request and again after it ends (a failed call fails the requests it carried,
    as their own ``Generate`` calls would have failed)."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, metadata: Metadata = ()) -> None:
        self._mux: MuxClient[int, generation_pb2.GenerateStreamRequest, generation_pb2.GenerateStreamResponse,
                             generation_pb2.GenerateResponse] = MuxClient(
            functools.partial(stub.GenerateStream, metadata=metadata), _GenerateStreamProtocol())
        self._next_id = 0

    @property
    def open_requests(self) -> int:
        return self._mux.open_requests

    def start(self, req: generation_pb2.GenerateRequest, timeout: float | None) -> MuxGenerateCall:
        self._next_id += 1
        msg = generation_pb2.GenerateStreamRequest(id=self._next_id, generate=req)
        if timeout is not None:
            msg.timeout_ms = max(1, math.ceil(timeout * 1000))
        return MuxGenerateCall(self._mux.start(self._next_id, msg, timeout=timeout))

    async def close(self) -> None:
        await self._mux.close()


# Starts a request on a tokenizer service not in the set given (indexes of those tried), within the timeout given;
# returns that service's index and the call.
StartOn = Callable[[set[int], float | None], tuple[int, GenerateCall]]


class FailoverCall:
    """A generation that moves to another tokenizer service while nothing has reached the client: a failure with
    UNAVAILABLE before the first delta (the service or its engine went away, or it drains) starts the request
    again on a service not tried yet, each at most once, within the request's own deadline. A failure after a
    delta ends the request, as does every other error: tokens sent cannot be taken back, and the other errors
    are the request's own."""

    def __init__(self, start: StartOn, services: int, timeout: float | None, request_id: str) -> None:
        self._start = start
        self._services = services
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._request_id = request_id
        self._tried: set[int] = set()
        self._cancelled = False
        self._call = self._next()

    def _next(self) -> GenerateCall:
        timeout = None if self._deadline is None else max(0.001, self._deadline - time.monotonic())
        index, call = self._start(self._tried, timeout)
        self._tried.add(index)
        return call

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            sent = False
            try:
                async for delta in self._call:
                    sent = True
                    yield delta
                return
            except BackendError as err:
                if (sent or self._cancelled or err.kind is not BackendErrorKind.UNAVAILABLE
                        or len(self._tried) >= self._services):
                    raise
                log.warning("request %s: %s; trying another tokenizer service", self._request_id, err.message)
            self._call = self._next()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


def pooling_inputs_to_pb(inputs: Sequence[PoolingInput]) -> list[generation_pb2.PoolingInput]:
    return [generation_pb2.PoolingInput(text=i.text) if i.text is not None else
            generation_pb2.PoolingInput(token_ids=common_pb2.TokenIds(ids=i.token_ids)) for i in inputs]


def set_pooling_options(req: Any, options: PoolingOptions, **flags: bool | None) -> None:
    """``truncate_prompt_tokens`` and the request's optional ``flags``, each set only when given (unset: the
    service's default)."""
    if options.truncate_prompt_tokens is not None:
        req.truncate_prompt_tokens = options.truncate_prompt_tokens
    for name, value in flags.items():
        if value is not None:
            setattr(req, name, value)


class GrpcBackend:
    """:class:`gateway.backend.Backend` over one ``grpc.aio`` channel (and, with ``mux``, one
    ``GenerateStream`` per tokenizer address on channels of their own). With ``api_key``, every call carries
    it (``authorization: Bearer`` metadata): the tokenizer services' public API asks for it when keyed."""

    def __init__(self, channel: grpc.aio.Channel, mux_channels: Sequence[grpc.aio.Channel] = (),
                 tracing: Tracing | None = None, api_key: str | None = None, services: int = 1) -> None:
        """``services``: how many tokenizer services ``channel`` balances over (a request tries each at most
        once)."""
        self._channel = channel
        self._services = max(services, len(mux_channels))
        self._tracing = tracing
        self._auth: Metadata = (bearer_metadata(api_key),) if api_key is not None else ()
        self._stub = generation_pb2_grpc.GenerationStub(channel)  # type: ignore[no-untyped-call]
        self._health = health_pb2_grpc.HealthStub(channel)
        self._mux_channels = list(mux_channels)
        self._streams = [GenerateStream(generation_pb2_grpc.GenerationStub(c),  # type: ignore[no-untyped-call]
                                        self._auth)
                         for c in self._mux_channels]
        self._turn = -1

    @classmethod
    def connect(cls, addresses: Sequence[str], *, mux: bool = False, tracing: Tracing | None = None,
                tls: GrpcTls | None = None, api_key: str | None = None) -> GrpcBackend:
        """Channels to ``addresses``, over TLS when ``tls`` is given (every channel alike)."""
        authority = tls_authority(addresses) if tls is not None else None
        channel = aio_channel(grpc_target(addresses), tls, options=channel_options(authority))
        addrs = [a.strip() for a in addresses if a.strip()]
        if not mux:
            return cls(channel, tracing=tracing, api_key=api_key, services=len(addrs))
        # One channel per address, so each stream goes to its own tokenizer service.
        return cls(channel, [aio_channel(grpc_target([a]), tls, options=channel_options()) for a in addrs],
                   tracing=tracing, api_key=api_key)

    def _metadata(self, request_id: str) -> Metadata:
        return (("x-request-id", request_id), *self._auth)

    def generate(self, prompt: Prompt, params: GenerationParams, *, request_id: str,
                 timeout: float | None, adapter: str = "") -> FailoverCall:
        req = generate_request_to_pb(prompt, params, request_id, adapter)
        if self._tracing is not None:
            self._tracing.inject_current(req.trace_headers)
        metadata = self._metadata(request_id)

        def start(tried: set[int], timeout: float | None) -> tuple[int, GenerateCall]:
            if self._streams:
                index = self._pick_stream(tried)
                return index, self._streams[index].start(req, timeout)
            # The channel's round robin picks the service (a healthy one).
            return len(tried), GrpcGenerateCall(self._stub.Generate(req, timeout=timeout, metadata=metadata))

        return FailoverCall(start, self._services, timeout, request_id)

    def _pick_stream(self, tried: set[int]) -> int:
        """Of the tokenizer services not tried yet, the healthy one with the fewest open requests, ties taken in
        turn. A service's channel is in TRANSIENT_FAILURE while it reports NOT_SERVING or cannot be reached
        (``gateway/targets.py``); when every one is, any (its error is then the request's)."""
        n = len(self._streams)
        self._turn = (self._turn + 1) % n
        order = [i for i in ((self._turn + k) % n for k in range(n)) if i not in tried]
        healthy = [i for i in order if self._mux_channels[i].get_state(try_to_connect=True)
                   not in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)]
        return min(healthy or order, key=lambda i: self._streams[i].open_requests)

    async def tokenize(self, prompt: Prompt, *, add_special_tokens: bool | None, return_token_strs: bool,
                       request_id: str, timeout: float | None, adapter: str = "") -> TokenizeResult:
        req = generation_pb2.TokenizeRequest(return_token_strs=return_token_strs, model=adapter)
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        if prompt.chat is not None:
            req.chat.CopyFrom(chat_to_pb(prompt))
        else:
            req.text = prompt.text or ""
        try:
            resp = await self._stub.Tokenize(req, timeout=timeout, metadata=self._metadata(request_id))
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None
        strs = tuple(resp.token_strs) if return_token_strs else None
        return TokenizeResult(tuple(resp.token_ids), resp.max_model_len, strs)

    async def detokenize(self, token_ids: tuple[int, ...], *, request_id: str, timeout: float | None,
                         adapter: str = "") -> str:
        req = generation_pb2.DetokenizeRequest(token_ids=token_ids, model=adapter)
        try:
            resp = await self._stub.Detokenize(req, timeout=timeout, metadata=self._metadata(request_id))
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None
        return str(resp.text)

    # -- pooling (gateway/pooling_schemas.py's PoolingBackend) ---------------------------------------------------
    async def _pooling_call(self, method: Callable[..., Any], req: Any, request_id: str, timeout: float | None) -> Any:
        """A unary pooling call; UNAVAILABLE (a service or its engine went away) tries the next service, each at most
        once: nothing was returned, and pooling has no side effects."""
        if self._tracing is not None:
            self._tracing.inject_current(req.trace_headers)
        for attempt in range(self._services):
            try:
                return await method(req, timeout=timeout, metadata=self._metadata(request_id))
            except grpc.aio.AioRpcError as err:
                error = to_backend_error(err)
                if error.kind is not BackendErrorKind.UNAVAILABLE or attempt + 1 >= self._services:
                    raise error from None
        raise AssertionError("unreachable")

    async def embed(self, inputs: Sequence[PoolingInput], options: PoolingOptions, *, dimensions: int | None,
                    task: str, request_id: str, timeout: float | None, model: str = "") -> Embeddings:
        req = generation_pb2.EmbedRequest(model=model, inputs=pooling_inputs_to_pb(inputs), task=task,
                                          priority=options.priority)
        set_pooling_options(req, options, normalize=options.activation, add_special_tokens=options.add_special_tokens)
        if dimensions is not None:
            req.dimensions = dimensions
        resp = await self._pooling_call(self._stub.Embed, req, request_id, timeout)
        return Embeddings(tuple(tuple(e.values) for e in resp.embeddings), tuple(e.row_size for e in resp.embeddings),
                          resp.usage.prompt_tokens)

    async def score(self, queries: Sequence[str], documents: Sequence[str], options: PoolingOptions, *,
                    request_id: str, timeout: float | None, model: str = "") -> Scores:
        req = generation_pb2.ScoreRequest(model=model, queries=queries, documents=documents, priority=options.priority)
        set_pooling_options(req, options, activation=options.activation)
        resp = await self._pooling_call(self._stub.Score, req, request_id, timeout)
        return Scores(tuple(resp.scores), resp.usage.prompt_tokens)

    async def classify(self, inputs: Sequence[PoolingInput], options: PoolingOptions, *, request_id: str,
                       timeout: float | None, model: str = "") -> Classifications:
        req = generation_pb2.ClassifyRequest(model=model, inputs=pooling_inputs_to_pb(inputs),
                                             priority=options.priority)
        set_pooling_options(req, options, activation=options.activation, add_special_tokens=options.add_special_tokens)
        resp = await self._pooling_call(self._stub.Classify, req, request_id, timeout)
        return Classifications(tuple(tuple(r.scores) for r in resp.results), tuple(r.label for r in resp.results),
                               resp.usage.prompt_tokens)

    async def pooling_tasks(self, *, timeout: float | None) -> tuple[str, ...]:
        try:
            resp = await self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout,
                                                 metadata=self._auth)
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None
        return tuple(resp.pooling_tasks)

    async def model_info(self, *, timeout: float | None) -> ModelInfo:
        try:
            resp = await self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=timeout,
                                                 metadata=self._auth)
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None
        return model_info_from_pb(resp)

    async def load_lora_adapter(self, name: str, path: str, base_model_name: str, *,
                                timeout: float | None) -> LoRAAdapter:
        req = common_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path, base_model_name=base_model_name)
        try:
            resp = await self._stub.LoadLoRAAdapter(req, timeout=timeout, metadata=self._auth)
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None
        return adapter_from_pb(resp.adapter)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None) -> None:
        try:
            await self._stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name=name), timeout=timeout,
                                               metadata=self._auth)
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None

    async def reset_prefix_cache(self, *, timeout: float | None) -> bool:
        try:
            resp = await self._stub.ResetPrefixCache(common_pb2.ResetPrefixCacheRequest(), timeout=timeout,
                                                     metadata=self._auth)
        except grpc.aio.AioRpcError as err:
            raise to_backend_error(err) from None
        return bool(resp.ok)

    async def check_ready(self, *, timeout: float) -> bool:
        """SERVING on the standard health service (NOT_SERVING while a backend drains),
        for the Generation service or else the whole server. A backend that reports
        neither counts as ready when it describes its model. The check goes to one healthy
        service (the channel's round robin skips the others): ready while any one is."""
        for service in (HEALTH_SERVICE, ""):
            try:
                resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # this name is not registered: try the next
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    break
                return False
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
        try:
            await self.model_info(timeout=timeout)
        except BackendError:
            return False
        return True

    async def close(self) -> None:
        for stream in self._streams:
            await stream.close()
        for channel in self._mux_channels:
            await channel.close()
        await self._channel.close()
