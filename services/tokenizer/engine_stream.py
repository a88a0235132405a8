"""Every engine request of a tokenizer service over one ``Engine.Stream`` call.

One call carries the requests and aborts up and one message per engine step down
(every output of the step for this service's requests), instead of one ``Generate``
call per request with one message per sequence per step. The messages are
demultiplexed here by request id into one iterator per request, which looks like
the ``Generate`` call it replaces: it yields ``EngineGenerateResponse`` messages
and raises ``grpc.aio.AioRpcError`` with the status a ``Generate`` call would
have ended with. An engine without ``Stream`` (UNIMPLEMENTED: an older engine)
is served by per-request ``Generate`` calls from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterator
from typing import TypeAlias

import grpc

from common.grpc_errors import ERROR_REASON_KEY, RETRY_AFTER_KEY
from common.stream_mux import MuxClient
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
_Entry: TypeAlias = tuple[str, engine_pb2.EngineGenerateResponse | None, bool, grpc.aio.AioRpcError | None]
_Outputs: TypeAlias = AsyncGenerator[engine_pb2.EngineGenerateResponse, None]


def _rpc_error(code: grpc.StatusCode, details: str, reason: int = engine_pb2.ERROR_REASON_UNSPECIFIED,
               retry_after_s: int | None = None) -> grpc.aio.AioRpcError:
    """The error a ``Generate`` call would have ended with, its reason and retry hint in the trailing metadata."""
    trailing = grpc.aio.Metadata()
    if reason:
        trailing.add(ERROR_REASON_KEY, engine_pb2.ErrorReason.Name(reason))
    if retry_after_s is not None:
        trailing.add(RETRY_AFTER_KEY, str(retry_after_s))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def error_reason(error: grpc.aio.AioRpcError) -> int:
    """The engine's typed reason for refusing a request (an ErrorReason value; UNSPECIFIED when it gave none),
    from a Generate call's trailing metadata or a Stream error entry alike."""
    for key, value in error.trailing_metadata() or ():
        if key == ERROR_REASON_KEY and isinstance(value, str) and value in engine_pb2.ErrorReason.keys():
            return int(engine_pb2.ErrorReason.Value(value))
    return engine_pb2.ERROR_REASON_UNSPECIFIED


class _EngineStreamProtocol:
    """``Engine.Stream`` for :class:`common.stream_mux.MuxClient`: outputs and refusals by request id, errors
    with the status (and typed reason) a ``Generate`` call would have ended with."""

    def entries(self, message: engine_pb2.EngineStreamResponse) -> Iterator[_Entry]:
        for err in message.errors:
            retry = err.retry_after_s if err.HasField("retry_after_s") else None
            yield err.request_id, None, True, _rpc_error(_STATUS_BY_CODE.get(err.code, grpc.StatusCode.UNKNOWN),
                                                         err.message, err.reason, retry)
        for out in message.outputs:
            yield out.request_id, out, out.request_done, None

    def abort(self, key: str) -> engine_pb2.EngineStreamRequest:
        return engine_pb2.EngineStreamRequest(abort=engine_pb2.AbortRequest(request_ids=[key]))

    def call_error(self, cause: BaseException | None) -> grpc.aio.AioRpcError:
        if isinstance(cause, grpc.aio.AioRpcError):
            return cause
        if cause is None:
            return _rpc_error(grpc.StatusCode.UNAVAILABLE, "the engine ended the stream")
        if isinstance(cause, asyncio.CancelledError):
            return _rpc_error(grpc.StatusCode.CANCELLED, "the engine stream was closed")
        return _rpc_error(grpc.StatusCode.INTERNAL, f"reading the engine stream failed: {cause!r}")

    def deadline_error(self) -> grpc.aio.AioRpcError:
        return _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")  # unused: no timeouts here


class EngineStream:
    """The tokenizer service's way to the engine: :meth:`generate` per request, one call underneath."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._stub = stub
        # The engine's handler sends its headers first; nothing goes up before (see MuxClient).
        self._mux: MuxClient[str, engine_pb2.EngineStreamRequest, engine_pb2.EngineStreamResponse,
                             engine_pb2.EngineGenerateResponse] = MuxClient(stub.Stream, _EngineStreamProtocol(),
                                                                            wait_for_headers=True)
        self.supported: bool | None = None  # None: not known yet; False: the engine has no Stream

    async def generate(self, request: engine_pb2.EngineGenerateRequest, *, timeout: float | None = None,
                       metadata: tuple[tuple[str, str], ...] = ()) -> _Outputs:
        """The engine's outputs for ``request`` until its last; leaving early aborts it. ``timeout`` and
        ``metadata`` only apply to the per-request ``Generate`` fallback (a Stream call outlives requests;
        the caller's own deadline ends its iteration, which aborts)."""
        if self.supported is False:
            async for msg in self._generate_unary(request, timeout, metadata):
                yield msg
            return
        rid = request.request_id
        if self._mux.is_open(rid):  # the engine would refuse it too; its answer could not be told apart
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: request {rid!r} is already running")
        pending = self._mux.start(rid, engine_pb2.EngineStreamRequest(generate=request))
        done = False
        try:
            async for item in pending:
                self.supported = True
                done = item.request_done
                yield item
        except grpc.aio.AioRpcError as error:
            done = True
            # Every request on the call sees it (several at once when they raced to the first call).
            if error.code() is not grpc.StatusCode.UNIMPLEMENTED or self.supported is True:
                raise
            if self.supported is None:
                logger.warning("the engine has no Stream RPC (an older engine?): one Generate "
                               "call per request from now on")
            self.supported = False
            async for msg in self._generate_unary(request, timeout, metadata):
                yield msg
        finally:
            if not done:
                pending.cancel()  # aborts it over the call

    async def _generate_unary(self, request: engine_pb2.EngineGenerateRequest, timeout: float | None,
                              metadata: tuple[tuple[str, str], ...]) -> _Outputs:
        call = self._stub.Generate(request, timeout=timeout, metadata=metadata)
        finished = False
        try:
            async for msg in call:
                yield msg
            finished = True
        finally:
            if not finished:
                call.cancel()

    def reset(self) -> None:
        """Drop the call (the engine restarted): requests on it fail, the next request opens a new one."""
        self._mux.reset()

    def close(self) -> None:
        self.reset()
