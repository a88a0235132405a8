"""Many requests over one bidirectional gRPC call, client and server halves, for any pair of message types.

One call carrying every request (and one message per step for all of them) instead of a call per request
cut the front processes' CPU per token by 24-37 % (docs/serving.md, "One message per step, not per token"),
so the deadlines, cancellation and per-request status that gRPC gives a call are rebuilt here, once, per
request: each request ends exactly once, with its own status; a broken call ends every request it carried.
A protocol adapter (``ClientProtocol``, ``SinkProtocol``, ``TaskProtocol``) maps one service's messages.

* :class:`MuxClient`: requests started with a key of the caller's choosing, each read through a
  :class:`MuxRequest` (its own queue and deadline, ``cancel()`` sends the protocol's abort on the call).
* :class:`SinkMux`: the server half for requests handed to a sink that produces whole messages (the engine:
  one message per step for all of the call's requests).
* :class:`TaskMux`: the server half running a task per request; the items every task produced while the
  writer was busy leave together, in one message (one event-loop turn carries a step's output for all).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import grpc

from common.grpc_errors import retry_after_s, status_for

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)  # a request's key on the call
V = TypeVar("V")  # what the server keeps per open request
Req = TypeVar("Req")  # a message from the client
Resp = TypeVar("Resp")  # a message from the server
P = TypeVar("P")  # one of a request's payloads (what its own call would have streamed)
Item = TypeVar("Item")  # a payload or an end, as it travels inside a server message
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)
Req_co = TypeVar("Req_co", covariant=True)
Req_contra = TypeVar("Req_contra", contravariant=True)
Resp_contra = TypeVar("Resp_contra", contravariant=True)
P_co = TypeVar("P_co", covariant=True)
P_contra = TypeVar("P_contra", contravariant=True)
Resp_co = TypeVar("Resp_co", covariant=True)


# -- client half ----------------------------------------------------------------------------------------------
class ClientProtocol(Protocol[K, Req_co, Resp_contra, P_co]):
    def entries(self, message: Resp_contra) -> Iterable[tuple[K, P_co | None, bool, BaseException | None]]:
        """A server message, request by request, in order: (key, payload or None, whether it is the request's
        last entry, the error it ends with or None)."""

    def abort(self, key: K) -> Req_co:
        """The message that aborts request ``key``."""

    def call_error(self, cause: BaseException | None) -> BaseException:
        """What every open request of an ended call raises: ``cause`` is None when the server ended it, the
        call's AioRpcError, CancelledError when it was closed here, or what broke reading it."""

    def deadline_error(self) -> BaseException:
        """What a request past its deadline raises (its abort is sent)."""


class MuxRequest(Generic[P]):
    """One request on a call: iterate its payloads (re-iterable until it ended); raises its error."""

    def __init__(self, call: _ClientCall[Any, Any, Any, P], key: Hashable, timeout: float | None) -> None:
        self._call = call
        self._key = key
        self._entries: deque[tuple[P | None, bool, BaseException | None]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None

    def deliver(self, payload: P | None, last: bool, error: BaseException | None) -> None:
        self._entries.append((payload, last, error))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[P]:
        loop = asyncio.get_running_loop()
        while True:
            if not self._entries:
                self._waiter = waiter = loop.create_future()
                expired: list[bool] = []

                def expire(waiter: asyncio.Future[None] = waiter, expired: list[bool] = expired) -> None:
                    expired.append(True)
                    waiter.cancel()

                timer = loop.call_at(self._deadline, expire) if self._deadline is not None else None
                try:
                    await waiter
                except asyncio.CancelledError:
                    if not expired:
                        raise  # our task was cancelled, not the deadline
                    self.cancel()
                    raise self._call.protocol.deadline_error() from None
                finally:
                    self._waiter = None
                    if timer is not None:
                        timer.cancel()
                continue
            payload, last, error = self._entries.popleft()
            if payload is not None:
                yield payload
            if last:
                if error is not None:
                    raise error
                return

    def cancel(self) -> None:
        """Stop reading it: sends its abort while it is open on a live call (no-op once it ended)."""
        self._call.cancel(self._key, self)


class _ClientCall(Generic[K, Req, Resp, P]):
    """One open call: the queue of its outgoing messages, the reader of its responses, its open requests."""

    def __init__(self, open_call: Callable[[AsyncIterator[Req]], Any], protocol: ClientProtocol[K, Req, Resp, P],
                 wait_for_headers: bool) -> None:
        self.protocol = protocol
        self.outbox: asyncio.Queue[Req | None] = asyncio.Queue()  # None ends the request iterator
        self.open: dict[K, MuxRequest[P]] = {}
        self.ended = False
        self._wait_for_headers = wait_for_headers
        self.rpc = open_call(self._requests())
        self.reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[Req]:
        if self._wait_for_headers:
            # Nothing goes up before the server took the call: a server without the method ends it at once
            # (UNIMPLEMENTED), and a message written into that ending call could turn its status into INTERNAL.
            await self.rpc.initial_metadata()
            if self.rpc.done():
                return
        while (msg := await self.outbox.get()) is not None:
            yield msg

    async def _read(self) -> None:
        cause: BaseException | None = None
        try:
            async for message in self.rpc:
                for key, payload, last, error in self.protocol.entries(message):
                    # Absent: cancelled here already (its abort is on the way), or not this call's.
                    request = self.open.pop(key, None) if last else self.open.get(key)
                    if request is not None:
                        request.deliver(payload, last, error)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            cause = e
        except Exception as e:  # noqa: BLE001 — never leave requests waiting on a reader that is gone
            logger.exception("reading a multiplexed stream failed")
            cause = e
            self.rpc.cancel()
        finally:
            self.ended = True
            self.outbox.put_nowait(None)  # ends the request iterator if grpc is still reading it
            stranded, self.open = self.open, {}
            if stranded:
                error = self.protocol.call_error(cause)
                for request in stranded.values():
                    request.deliver(None, True, error)

    def start(self, key: K, message: Req, timeout: float | None) -> MuxRequest[P]:
        request = MuxRequest(self, key, timeout)
        self.open[key] = request
        self.outbox.put_nowait(message)
        return request

    def cancel(self, key: K, request: MuxRequest[P]) -> None:
        if self.open.get(key) is request:
            del self.open[key]
            if not self.ended:
                self.outbox.put_nowait(self.protocol.abort(key))

    def close(self) -> None:
        self.outbox.put_nowait(None)
        self.rpc.cancel()
        self.reader.cancel()


class MuxClient(Generic[K, Req, Resp, P]):
    """Requests multiplexed on one call at a time, opened by ``open_call(request_iterator)`` on the first
    request and again after the last call ended (which failed the requests it carried)."""

    def __init__(self, open_call: Callable[[AsyncIterator[Req]], Any], protocol: ClientProtocol[K, Req, Resp, P],
                 *, wait_for_headers: bool = False) -> None:
        self._open_call = open_call
        self._protocol = protocol
        self._wait_for_headers = wait_for_headers
        self._call: _ClientCall[K, Req, Resp, P] | None = None

    @property
    def open_requests(self) -> int:
        return len(self._call.open) if self._call is not None else 0

    def is_open(self, key: K) -> bool:
        return self._call is not None and key in self._call.open

    def start(self, key: K, message: Req, *, timeout: float | None = None) -> MuxRequest[P]:
        """Send ``message`` (which starts request ``key``, unique among the open ones); with ``timeout``
        (seconds), reading it past then aborts it and raises the protocol's deadline error."""
        if self._call is None or self._call.ended:
            self._call = _ClientCall(self._open_call, self._protocol, self._wait_for_headers)
        return self._call.start(key, message, timeout)

    def reset(self) -> None:
        """Cancel the call (its requests fail with the protocol's error); the next request opens a new one."""
        if self._call is not None:
            self._call.close()
            self._call = None

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.close()
            await asyncio.gather(call.reader, return_exceptions=True)


# -- server half ----------------------------------------------------------------------------------------------
class _MuxServer(ABC, Generic[K, V, Req, Resp]):
    """One call's server side: reads the client's messages into ``receive``, writes what :meth:`_take` gives
    as it becomes ready, ends once the client half-closed (or :meth:`drain`) and every request ended, and
    aborts the unfinished ones when the call ends any other way. An error ``receive`` raises ends the call."""

    def __init__(self, receive: Callable[[Req], None]) -> None:
        self._receive = receive
        self.requests: dict[K, V] = {}  # the open requests
        self._ready = asyncio.Event()
        self._reading = True
        self._draining = False
        self._closing = False
        self._error: Exception | None = None

    async def run(self, requests: AsyncIterator[Req]) -> AsyncIterator[Resp]:
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                if self._error is not None:
                    raise self._error
                message = self._take()
                if message is not None:
                    yield message
                    continue
                if (not self._reading or self._draining) and not self.requests:
                    return  # half-closed (or draining) and every request ended
                self._ready.clear()
                await self._ready.wait()
        finally:
            self._closing = True
            reader.cancel()
            await self._abort_unfinished()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[Req]) -> None:
        try:
            async for message in requests:
                self._receive(message)
        except Exception as e:  # noqa: BLE001 — ends the call with its status (see run)
            self._error = e
        finally:
            self._reading = False
            self._ready.set()

    def drain(self) -> None:
        """End the call once the open requests ended, half-closed or not."""
        self._draining = True
        self._ready.set()

    @abstractmethod
    def _take(self) -> Resp | None:
        """The next message to send, or None when nothing is ready."""

    @abstractmethod
    async def _abort_unfinished(self) -> None:
        """Abort the requests still open when the call ends."""


class SinkProtocol(Protocol[K, Req_contra]):
    def receive(self, message: Req_contra) -> None:
        """One client message: register requests with :meth:`SinkMux.open`, abort them, or raise."""

    def abort(self, keys: list[K]) -> None:
        """The call ended with these requests unfinished."""


class SinkMux(_MuxServer[K, V, Req, Resp]):
    """The server half for requests handed to a sink (``open``) that sends whole messages (``send``), e.g.
    one per step for every request of the call, and says when each request ended (``finish``)."""

    def __init__(self, protocol: SinkProtocol[K, Req]) -> None:
        super().__init__(protocol.receive)
        self._protocol = protocol
        self._out: deque[Resp] = deque()

    def open(self, key: K, state: V) -> None:
        self.requests[key] = state

    def finish(self, key: K) -> None:
        self.requests.pop(key, None)
        if not self.requests:
            self._ready.set()  # run() may be waiting for the last request to end

    def send(self, message: Resp) -> None:
        self._out.append(message)
        self._ready.set()

    def _take(self) -> Resp | None:
        return self._out.popleft() if self._out else None

    async def _abort_unfinished(self) -> None:
        if self.requests:
            unfinished, self.requests = list(self.requests), {}
            self._protocol.abort(unfinished)


class TaskProtocol(Protocol[K_contra, Req_contra, P_contra, Item, Resp_co]):
    def receive(self, message: Req_contra) -> None:
        """One client message: :meth:`TaskMux.spawn`, ``cancel`` or ``end`` requests, or raise."""

    def item(self, key: K_contra, payload: P_contra) -> Item:
        """A payload of request ``key`` as it travels."""

    def end_item(self, key: K_contra, code: grpc.StatusCode, message: str, last: Item | None,
                 retry_after_s: int | None = None) -> Item | None:
        """The item ending request ``key`` with a status (and, for a refusal, the seconds after which to retry,
        when said), or None once that end is set on ``last`` (the last item not sent yet, when the protocol lets
        an end ride on it)."""

    def pack(self, items: list[Item]) -> Resp_co:
        """The items ready together, as one message."""


class TaskMux(_MuxServer[K, asyncio.Task[None], Req, Resp], Generic[K, Req, P, Item, Resp]):
    """The server half running a task per request (``spawn``): it ends with OK, the status of what it raised
    (:func:`common.grpc_errors.status_for`), CANCELLED (``cancel``) or DEADLINE_EXCEEDED; one end each, also
    for a task cancelled before it ever ran. Unfinished tasks are cancelled when the call ends."""

    def __init__(self, protocol: TaskProtocol[K, Req, P, Item, Resp]) -> None:
        super().__init__(protocol.receive)
        self._protocol = protocol
        self._batch: list[Item] = []
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._cancelled: set[K] = set()  # by the client: end with CANCELLED
        self._expired: set[K] = set()  # past their deadline: end with DEADLINE_EXCEEDED

    def spawn(self, key: K, payloads: AsyncIterator[P], *, timeout: float | None = None, name: str = "") -> None:
        """Run request ``key`` (not open: the caller checks): send ``payloads``, then its end."""
        task = asyncio.ensure_future(self._handle(key, payloads, name or str(key)))
        self.requests[key] = task
        if timeout:
            self._timers[key] = asyncio.get_running_loop().call_later(timeout, self._expire, key)
        task.add_done_callback(functools.partial(self._handled, key))

    def cancel(self, key: K) -> None:
        """End request ``key`` with CANCELLED; keys not open are ignored."""
        task = self.requests.get(key)
        if task is not None and key not in self._cancelled:
            self._cancelled.add(key)
            task.cancel()

    def end(self, key: K, code: grpc.StatusCode, message: str, retry_after_s: int | None = None) -> None:
        """Send the end of request ``key``: on its last item when that has not left yet, else on its own."""
        item = self._protocol.end_item(key, code, message, self._batch[-1] if self._batch else None, retry_after_s)
        if item is not None:
            self._batch.append(item)
        self._ready.set()

    def _expire(self, key: K) -> None:
        task = self.requests.get(key)
        if task is not None and key not in self._cancelled:
            self._expired.add(key)
            task.cancel()

    async def _handle(self, key: K, payloads: AsyncIterator[P], name: str) -> None:
        try:
            async for payload in payloads:
                self._batch.append(self._protocol.item(key, payload))
                self._ready.set()
        except asyncio.CancelledError:
            raise  # ended by _handled
        except Exception as e:  # noqa: BLE001 — the request's own status, as its own call would end
            code, message = status_for(e)
            if code is grpc.StatusCode.INTERNAL:
                logger.exception("unexpected error in multiplexed request %s", name, exc_info=e)
            retry = retry_after_s(e)
        else:
            code, message, retry = grpc.StatusCode.OK, "", None
        # Here, not in _handled: the end then rides on the last payload if that has not left yet.
        self.end(key, code, message, retry)

    def _handled(self, key: K, task: asyncio.Task[None]) -> None:
        del self.requests[key]
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        expired, cancelled = key in self._expired, key in self._cancelled
        self._expired.discard(key)
        self._cancelled.discard(key)
        if not task.cancelled():  # it sent its own end
            self._ready.set()  # run() may be waiting for the last request to end
        elif expired:
            self.end(key, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        elif cancelled or not self._closing:
            self.end(key, grpc.StatusCode.CANCELLED, "cancelled")
        # else the whole call is going away: nobody to tell

    def _take(self) -> Resp | None:
        if not self._batch:
            return None
        items, self._batch = self._batch, []
        return self._protocol.pack(items)

    async def _abort_unfinished(self) -> None:
        tasks = list(self.requests.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
