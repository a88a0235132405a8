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
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeAlias

import grpc

from common.grpc_errors import ERROR_REASON_KEY
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}
_ERROR = engine_pb2.EngineRequestError
_Item: TypeAlias = engine_pb2.EngineGenerateResponse | grpc.aio.AioRpcError
_Outputs: TypeAlias = AsyncGenerator[engine_pb2.EngineGenerateResponse, None]


def _rpc_error(code: grpc.StatusCode, details: str,
               reason: int = engine_pb2.ERROR_REASON_UNSPECIFIED) -> grpc.aio.AioRpcError:
    trailing = (grpc.aio.Metadata((ERROR_REASON_KEY, engine_pb2.ErrorReason.Name(reason))) if reason
                else grpc.aio.Metadata())
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def error_reason(error: grpc.aio.AioRpcError) -> int:
    """The engine's typed reason for refusing a request (an ErrorReason value; UNSPECIFIED when it gave none),
    from a Generate call's trailing metadata or a Stream error entry alike."""
    for key, value in error.trailing_metadata() or ():
        if key == ERROR_REASON_KEY and isinstance(value, str) and value in engine_pb2.ErrorReason.keys():
            return int(engine_pb2.ErrorReason.Value(value))
    return engine_pb2.ERROR_REASON_UNSPECIFIED


class _Call:
    """One open ``Stream`` call: its request queue, the reader of its responses, its live requests."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self.outgoing: asyncio.Queue[engine_pb2.EngineStreamRequest | None] = asyncio.Queue()
        self.requests: dict[str, asyncio.Queue[_Item]] = {}
        self.failed: grpc.aio.AioRpcError | None = None
        self.rpc = stub.Stream(self._requests())
        self.reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[engine_pb2.EngineStreamRequest]:
        # Nothing goes up before the engine has taken the call (its handler sends the headers first): an
        # engine without Stream ends the call at once with UNIMPLEMENTED, and a message written into that
        # ending call could turn the status into an INTERNAL "execute_batch" failure instead.
        await self.rpc.initial_metadata()
        if self.rpc.done():
            return
        while (msg := await self.outgoing.get()) is not None:
            yield msg

    async def _read(self) -> None:
        try:
            async for msg in self.rpc:
                for err in msg.errors:
                    self._put(err.request_id, _rpc_error(
                        _STATUS_BY_CODE.get(err.code, grpc.StatusCode.UNKNOWN), err.message, err.reason), last=True)
                for out in msg.outputs:
                    self._put(out.request_id, out, last=out.request_done)
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the engine ended the stream")
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the engine stream was closed")
        except Exception as e:  # never leave requests waiting on a reader that is gone
            logger.exception("reading the engine stream failed")
            error = _rpc_error(grpc.StatusCode.INTERNAL, f"reading the engine stream failed: {e!r}")
            self.rpc.cancel()
        self.failed = error
        self.outgoing.put_nowait(None)  # ends the request iterator if grpc is still reading it
        for queue in self.requests.values():
            queue.put_nowait(error)
        self.requests.clear()

    def _put(self, request_id: str, item: _Item, *, last: bool) -> None:
        # Absent: the request was left early (its abort is on the way) or is not this call's.
        queue = self.requests.pop(request_id, None) if last else self.requests.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def close(self) -> None:
        self.outgoing.put_nowait(None)
        self.rpc.cancel()
        self.reader.cancel()


class EngineStream:
    """The tokenizer service's way to the engine: :meth:`generate` per request, one call underneath."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._stub = stub
        self._call: _Call | None = None
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
        call = self._open()
        rid = request.request_id
        if rid in call.requests:  # the engine would refuse it too; its answer could not be told apart
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: request {rid!r} is already running")
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        call.requests[rid] = queue
        call.outgoing.put_nowait(engine_pb2.EngineStreamRequest(generate=request))
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, grpc.aio.AioRpcError):
                    done = True
                    # Every request on the call sees it (several at once when they raced to the first call).
                    if item.code() is grpc.StatusCode.UNIMPLEMENTED and self.supported is not True:
                        if self.supported is None:
                            logger.warning("the engine has no Stream RPC (an older engine?): one Generate "
                                           "call per request from now on")
                        self.supported = False
                        self._call = None
                        async for msg in self._generate_unary(request, timeout, metadata):
                            yield msg
                        return
                    raise item
                self.supported = True
                done = item.request_done
                yield item
                if done:
                    return
        finally:
            if not done:
                call.requests.pop(rid, None)
                if call.failed is None:
                    call.outgoing.put_nowait(engine_pb2.EngineStreamRequest(
                        abort=engine_pb2.AbortRequest(request_ids=[rid])))

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

    def _open(self) -> _Call:
        """The open call, or a new one when there is none or the last one failed (engine restarted)."""
        if self._call is None or self._call.failed is not None:
            self._call = _Call(self._stub)
        return self._call

    def reset(self) -> None:
        """Drop the call (the engine restarted): requests on it fail, the next request opens a new one."""
        if self._call is not None:
            self._call.close()
            self._call = None

    def close(self) -> None:
        self.reset()
