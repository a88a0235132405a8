"""``GenerateStream``'s protocol adapter: a task per open request (common.stream_mux.TaskMux), each ending
with exactly one end item that carries the status its own ``Generate`` call would have ended with."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from common.errors import InvalidRequestError
from common.stream_mux import TaskMux
from proto.sluice.v1 import generation_pb2


class Generator(Protocol):
    """What the multiplexer needs of the servicer."""

    draining: bool

    def generate(self, request: generation_pb2.GenerateRequest, request_id: str, *, timeout: float | None
                 ) -> AsyncIterator[generation_pb2.GenerateResponse]: ...


class Multiplexer:
    """One ``GenerateStream`` call: the protocol of :class:`common.stream_mux.TaskMux`, a task per open request
    whose items go out batched (a step's deltas for every request of the stream in one message), each request
    ending with exactly one end item that carries the status its own ``Generate`` call would have ended with."""

    def __init__(self, servicer: Generator) -> None:
        self._servicer = servicer
        self._mux: TaskMux[int, generation_pb2.GenerateStreamRequest, generation_pb2.GenerateResponse,
                           generation_pb2.GenerateStreamItem, generation_pb2.GenerateStreamResponse] = TaskMux(self)
        self.wake()

    def run(self, requests: AsyncIterator[generation_pb2.GenerateStreamRequest]
            ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        return self._mux.run(requests)

    def wake(self) -> None:
        """Shutting down: take no new requests, end once the open ones have (half-closed or not)."""
        if self._servicer.draining:
            self._mux.drain()

    def receive(self, req: generation_pb2.GenerateStreamRequest) -> None:
        action = req.WhichOneof("action")
        if action == "generate":
            if req.id in self._mux.requests:
                raise InvalidRequestError("id", f"request {req.id} is still open on this stream")
            if self._servicer.draining:
                self._mux.end(req.id, grpc.StatusCode.UNAVAILABLE, "the tokenizer service is shutting down")
                return
            timeout = req.timeout_ms / 1000 if req.timeout_ms else None
            request_id = req.generate.request_id or f"gen-{uuid.uuid4().hex}"
            self._mux.spawn(req.id, self._servicer.generate(req.generate, request_id, timeout=timeout),
                            timeout=timeout, name=request_id)
        elif action == "cancel":
            self._mux.cancel(req.id)
        else:
            raise InvalidRequestError("action", "each message needs `generate` or `cancel`")

    def item(self, id_: int, response: generation_pb2.GenerateResponse) -> generation_pb2.GenerateStreamItem:
        return generation_pb2.GenerateStreamItem(id=id_, response=response)

    def end_item(self, id_: int, code: grpc.StatusCode, message: str, last: generation_pb2.GenerateStreamItem | None,
                 retry_after_s: int | None = None) -> generation_pb2.GenerateStreamItem | None:
        item = last if last is not None and last.id == id_ and not last.end else generation_pb2.GenerateStreamItem(
            id=id_)
        item.end = True
        item.status_code = code.value[0]
        item.status_message = message
        if retry_after_s:
            item.retry_after_seconds = retry_after_s
        return None if item is last else item

    def pack(self, items: list[generation_pb2.GenerateStreamItem]) -> generation_pb2.GenerateStreamResponse:
        return generation_pb2.GenerateStreamResponse(items=items)
