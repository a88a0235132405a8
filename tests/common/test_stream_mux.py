"""common.stream_mux on plain Python messages, in one event loop: the client half against a scripted call,
the server halves against a scripted client. Each request ends exactly once, with its own status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from common.errors import InvalidRequestError
from common.stream_mux import MuxClient, SinkMux, TaskMux

OK, CANCELLED, DEADLINE = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED
Entry = tuple[str, Any, bool, BaseException | None]


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))  # type: ignore[arg-type]


# -- client half ----------------------------------------------------------------------------------------------
class CallFailed(Exception):
    def __init__(self, cause: BaseException | None) -> None:
        super().__init__(repr(cause))
        self.cause = cause


class Expired(Exception):
    pass


class Refused(Exception):
    pass


class ClientProto:
    """Server messages are lists of entries as they are; aborts are ("abort", key)."""

    def entries(self, message: list[Entry]) -> list[Entry]:
        return message

    def abort(self, key: str) -> tuple[str, str]:
        return ("abort", key)

    def call_error(self, cause: BaseException | None) -> CallFailed:
        return CallFailed(cause)

    def deadline_error(self) -> Expired:
        return Expired()


class ScriptedCall:
    """What MuxClient needs of a grpc.aio.StreamStreamCall: the test ``respond``s, ``fail``s or ``end``s it."""

    def __init__(self, requests: AsyncIterator[Any], headers: asyncio.Future[None]) -> None:
        self.sent: list[Any] = []
        self.cancelled = False
        self.ended = False
        self._headers = headers
        self._responses: asyncio.Queue[list[Entry] | BaseException | None] = asyncio.Queue()
        self.pump = asyncio.ensure_future(self._pump(requests))

    async def _pump(self, requests: AsyncIterator[Any]) -> None:
        async for msg in requests:
            self.sent.append(msg)

    def respond(self, *entries: Entry) -> None:
        self._responses.put_nowait(list(entries))

    def fail(self, error: BaseException) -> None:
        self._responses.put_nowait(error)

    def end(self) -> None:
        self._responses.put_nowait(None)

    async def initial_metadata(self) -> None:
        await self._headers

    def done(self) -> bool:
        return self.ended

    def cancel(self) -> None:
        self.cancelled = True
        self._responses.put_nowait(asyncio.CancelledError())

    async def __aiter__(self) -> AsyncIterator[list[Entry]]:
        while (msg := await self._responses.get()) is not None:
            if isinstance(msg, BaseException):
                self.ended = True
                raise msg
            yield msg
        self.ended = True


class Harness:
    def __init__(self, *, wait_for_headers: bool = False) -> None:
        self.calls: list[ScriptedCall] = []
        self.headers: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not wait_for_headers:
            self.headers.set_result(None)
        self.client: MuxClient[str, Any, list[Entry], str] = MuxClient(self._open, ClientProto(),
                                                                       wait_for_headers=wait_for_headers)

    def _open(self, requests: AsyncIterator[Any]) -> ScriptedCall:
        self.calls.append(ScriptedCall(requests, self.headers))
        return self.calls[-1]


async def read(request: AsyncIterable[str]) -> tuple[list[str], BaseException | None]:
    got: list[str] = []
    try:
        async for payload in request:
            got.append(payload)
    except Exception as e:  # noqa: BLE001 — what ended it, for the test to look at
        return got, e
    return got, None


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_payloads_reach_their_request_in_order_and_the_last_entry_ends_it() -> None:
    async def main() -> tuple[Any, ...]:
        h = Harness()
        a = h.client.start("a", ("start", "a"))
        b = h.client.start("b", ("start", "b"))
        reads = asyncio.gather(read(a), read(b))
        await turns()
        call = h.calls[0]
        call.respond(("a", "a0", False, None), ("b", "b0", False, None), ("a", "a1", False, None))
        call.respond(("b", "b1", True, None), ("a", None, True, None), ("zz", "unknown", False, None))
        return await reads, call.sent, h.client.open_requests, len(h.calls)

    (a, b), sent, open_requests, calls = run(main())
    assert a == (["a0", "a1"], None) and b == (["b0", "b1"], None)
    assert sent == [("start", "a"), ("start", "b")] and open_requests == 0 and calls == 1


def test_an_error_entry_ends_its_request_only_after_its_payload() -> None:
    async def main() -> tuple[Any, ...]:
        h = Harness()
        a, b = h.client.start("a", "start a"), h.client.start("b", "start b")
        reads = asyncio.gather(read(a), read(b))
        await turns()
        h.calls[0].respond(("a", "a0", True, Refused("no")), ("b", "b0", False, None))
        h.calls[0].respond(("b", "b1", True, None))
        return await reads

    (a_got, a_err), b = run(main())
    assert a_got == ["a0"] and isinstance(a_err, Refused) and b == (["b0", "b1"], None)


def test_a_deadline_raises_the_protocol_error_and_aborts_on_the_call_once() -> None:
    async def main() -> tuple[Any, ...]:
        h = Harness()
        slow = h.client.start("slow", "start slow", timeout=0.05)
        other = h.client.start("other", "start other")
        outcome = await read(slow)
        slow.cancel()  # already aborted: nothing more goes up
        h.calls[0].respond(("slow", "late", True, None), ("other", "o", True, None))
        await turns()
        return outcome, await read(other), h.calls[0].sent

    (got, error), other, sent = run(main())
    assert got == [] and isinstance(error, Expired)
    assert other == (["o"], None)
    assert sent == ["start slow", "start other", ("abort", "slow")]


def test_cancel_aborts_only_an_open_request_and_nothing_more_reaches_it() -> None:
    async def main() -> tuple[Any, ...]:
        h = Harness()
        a, b = h.client.start("a", "start a"), h.client.start("b", "start b")
        h.calls[0].respond(("b", "b0", True, None))
        assert await read(b) == (["b0"], None)
        b.cancel()  # ended: no abort
        a.cancel()
        a.cancel()
        h.calls[0].respond(("a", "a0", True, None))  # the server had not seen the abort yet
        await turns()
        return a._entries, h.calls[0].sent, h.client.is_open("a")  # noqa: SLF001

    entries, sent, open_ = run(main())
    assert not entries and not open_
    assert sent == ["start a", "start b", ("abort", "a")]


@pytest.mark.parametrize("how", ["fail", "end"])
def test_a_call_that_ends_fails_every_open_request_once_and_the_next_request_opens_a_new_call(how: str) -> None:
    status = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")

    async def main() -> tuple[Any, ...]:
        h = Harness()
        done = h.client.start("done", "start done")
        a, b = h.client.start("a", "start a"), h.client.start("b", "start b")
        h.calls[0].respond(("done", "d", True, None), ("a", "a0", False, None))
        reads = asyncio.gather(read(done), read(a), read(b))
        await turns()
        h.calls[0].fail(status) if how == "fail" else h.calls[0].end()
        outcomes = await reads
        await turns()
        pump_ended = h.calls[0].pump.done()  # the failed call's request iterator ended
        a.cancel()  # on a failed call: nothing to send
        again = h.client.start("a", "start a again")
        h.calls[1].respond(("a", "x", True, None))
        return outcomes, pump_ended, await read(again), [c.sent for c in h.calls]

    (done, a, b), pump_ended, again, sent = run(main())
    assert done == (["d"], None)
    assert a[0] == ["a0"] and b[0] == []
    for _, error in (a, b):
        assert isinstance(error, CallFailed) and error.cause is (status if how == "fail" else None)
    assert a[1] is b[1]  # one error for the call, raised once by each request
    assert pump_ended and again == (["x"], None)
    assert sent == [["start done", "start a", "start b"], ["start a again"]]


def test_close_cancels_the_call_and_its_requests_fail_as_cancelled() -> None:
    async def main() -> tuple[Any, ...]:
        h = Harness()
        reading = asyncio.ensure_future(read(h.client.start("a", "start a")))
        await turns()
        await h.client.close()
        return await reading, h.calls[0].cancelled, h.client.open_requests

    (got, error), cancelled, open_requests = run(main())
    assert got == [] and isinstance(error, CallFailed) and isinstance(error.cause, asyncio.CancelledError)
    assert cancelled and open_requests == 0


def test_with_wait_for_headers_nothing_goes_up_before_the_server_took_the_call() -> None:
    async def main() -> tuple[Any, ...]:
        h = Harness(wait_for_headers=True)
        h.client.start("a", "start a")
        await turns()
        before = list(h.calls[0].sent)
        h.headers.set_result(None)
        await turns()
        return before, h.calls[0].sent

    assert run(main()) == ([], ["start a"])


# -- server half: a task per request ---------------------------------------------------------------------------
class Item:
    """A payload and/or the end of request ``key``."""

    def __init__(self, key: int, payload: str | None = None) -> None:
        self.key, self.payload = key, payload
        self.end: tuple[grpc.StatusCode, str] | None = None

    def __repr__(self) -> str:
        return f"Item({self.key}, {self.payload!r}, {self.end})"


Handler = Callable[[], AsyncIterator[str]]


class TaskProto:
    """Client messages: ("start", key, handler, timeout) | ("cancel", key) | ("refuse", key) | anything else."""

    def __init__(self) -> None:
        self.mux: TaskMux[int, tuple[Any, ...], str, Item, list[Item]] = TaskMux(self)

    def receive(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "start":
            self.mux.spawn(msg[1], msg[2](), timeout=msg[3])
        elif msg[0] == "cancel":
            self.mux.cancel(msg[1])
        elif msg[0] == "refuse":
            self.mux.end(msg[1], grpc.StatusCode.UNAVAILABLE, "shutting down")
        else:
            raise InvalidRequestError("action", "unknown")

    def item(self, key: int, payload: str) -> Item:
        return Item(key, payload)

    def end_item(self, key: int, code: grpc.StatusCode, message: str, last: Item | None,
                 retry_after_s: int | None = None) -> Item | None:
        item = last if last is not None and last.key == key and last.end is None else Item(key)
        item.end = (code, message)
        return None if item is last else item

    def pack(self, items: list[Item]) -> list[Item]:
        return items


class Log:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.closed: list[str] = []

    def steps(self, name: str, n: int, fail: Exception | None = None) -> Handler:
        async def handler() -> AsyncIterator[str]:
            self.started.append(name)
            try:
                for i in range(n):
                    if i:
                        await asyncio.sleep(0.01)  # a step
                    yield f"{name}{i}"
                if fail is not None:
                    raise fail
            finally:
                self.closed.append(name)

        return handler


async def script(*msgs: tuple[Any, ...] | float) -> AsyncIterator[tuple[Any, ...]]:
    """The client: messages (several in one turn), a float sleeps; then it half-closes."""
    for m in msgs:
        if isinstance(m, float):
            await asyncio.sleep(m)
        else:
            yield m


async def collect(mux: TaskMux[int, Any, str, Item, list[Item]] | SinkMux[Any, Any, Any, Any],
                  requests: AsyncIterator[Any]) -> list[Any]:
    return [message async for message in mux.run(requests)]


def ends_once(messages: list[list[Item]], reused: frozenset[int] = frozenset()) -> dict[int, list[Item]]:
    """Items by key; an item after its key's end fails, unless the key is in ``reused`` (started again)."""
    by_key: dict[int, list[Item]] = {}
    for message in messages:
        for item in message:
            if item.key not in reused:
                assert not (by_key.get(item.key) and by_key[item.key][-1].end), f"{item} after its end"
            by_key.setdefault(item.key, []).append(item)
    return by_key


def test_tasks_items_leave_batched_and_each_ends_once_with_its_status() -> None:
    log = Log()

    async def main() -> list[list[Item]]:
        proto = TaskProto()
        return await collect(proto.mux, script(("start", 1, log.steps("a", 3), None),
                                               ("start", 2, log.steps("b", 0, InvalidRequestError("x", "bad")), None),
                                               ("start", 3, log.steps("c", 3), None), ("refuse", 4)))

    messages = run(main())
    got = ends_once(messages)
    assert [i.payload for i in got[1]] == ["a0", "a1", "a2"] and got[1][-1].end == (OK, "")
    assert [(i.payload, i.end) for i in got[2]] == [(None, (grpc.StatusCode.INVALID_ARGUMENT, "x: bad"))]
    assert [(i.payload, i.end) for i in got[4]] == [(None, (grpc.StatusCode.UNAVAILABLE, "shutting down"))]
    # a0, c0 (and the two ends) in the first turn; then one message per step for both.
    assert [[(i.key, i.payload) for i in m] for m in messages] == [
        [(4, None), (1, "a0"), (2, None), (3, "c0")], [(1, "a1"), (3, "c1")], [(1, "a2"), (3, "c2")]]


def test_cancel_and_deadline_end_their_tasks_and_a_cancel_in_the_same_turn_means_it_never_ran() -> None:
    log = Log()

    async def main() -> dict[int, list[Item]]:
        proto = TaskProto()
        return ends_once(await collect(proto.mux, script(
            ("start", 1, log.steps("never", 10**6), None), ("cancel", 1), ("cancel", 9),
            ("start", 2, log.steps("cancelled", 10**6), None), ("start", 3, log.steps("expires", 10**6), 0.05),
            0.1, ("cancel", 2), ("cancel", 2), 0.05, ("start", 2, log.steps("again", 1), None))), reused=frozenset({2}))

    got = run(main())
    assert [i.end for i in got[1]] == [(CANCELLED, "cancelled")] and 9 not in got
    assert got[3][-1].end == (DEADLINE, "deadline exceeded") and len(got[3]) > 1
    assert [i.end for i in got[2] if i.end] == [(CANCELLED, "cancelled"), (OK, "")]  # an ended key is free again
    assert "never" not in log.started
    assert sorted(log.closed) == ["again", "cancelled", "expires"]


def test_an_error_reading_the_client_ends_the_call_and_cancels_open_tasks_silently() -> None:
    log = Log()

    async def main() -> list[list[Item]]:
        proto = TaskProto()
        got: list[list[Item]] = []
        with pytest.raises(InvalidRequestError, match="unknown"):
            async for message in proto.mux.run(script(("start", 1, log.steps("open", 10**6), None), 0.05,
                                                      ("bogus",), 5.0)):
                got.append(message)
        return got

    messages = run(main())
    assert all(i.end is None for m in messages for i in m)  # the call went away: no ends
    assert log.closed == ["open"]


def test_drain_ends_the_call_once_open_tasks_ended_without_a_half_close() -> None:
    log = Log()

    async def main() -> dict[int, list[Item]]:
        proto = TaskProto()
        messages = []

        async def client() -> AsyncIterator[tuple[Any, ...]]:
            yield ("start", 1, log.steps("a", 3), None)
            await asyncio.sleep(0.005)
            proto.mux.drain()
            await asyncio.sleep(3600)  # never half-closes

        async for message in proto.mux.run(client()):
            messages.append(message)
        return ends_once(messages)

    got = run(main())
    assert [i.payload for i in got[1]] == ["a0", "a1", "a2"] and got[1][-1].end == (OK, "")


# -- server half: requests handed to a sink ---------------------------------------------------------------------
class Sink:
    """Client messages: ("open", key) | ("close", key): ends it with a message | ("fail",): raises."""

    def __init__(self) -> None:
        self.mux: SinkMux[str, int, tuple[str, ...], str] = SinkMux(self)
        self.aborted: list[list[str]] = []

    def receive(self, msg: tuple[str, ...]) -> None:
        if msg[0] == "open":
            self.mux.open(msg[1], 0)
            self.mux.send(f"{msg[1]} started")
        elif msg[0] == "close":
            self.mux.send(f"{msg[1]} done")
            self.mux.finish(msg[1])
        else:
            raise InvalidRequestError("kind", "unknown")

    def abort(self, keys: list[str]) -> None:
        self.aborted.append(keys)


def test_sink_messages_leave_in_order_and_the_call_ends_after_half_close_once_every_request_finished() -> None:
    async def main() -> tuple[list[str], list[list[str]]]:
        sink = Sink()

        async def later() -> None:
            await asyncio.sleep(0.05)
            sink.mux.send("b step")
            sink.mux.finish("b")

        task = asyncio.ensure_future(later())
        messages = await collect(sink.mux, script(("open", "a"), ("open", "b"), ("close", "a")))
        await task
        return messages, sink.aborted

    messages, aborted = run(main())
    assert messages == ["a started", "b started", "a done", "b step"] and aborted == []


def test_sink_requests_unfinished_when_the_call_ends_are_aborted_once() -> None:
    async def main() -> list[list[str]]:
        sink = Sink()
        with pytest.raises(InvalidRequestError):
            await collect(sink.mux, script(("open", "a"), ("open", "b"), ("close", "a"), 0.01, ("fail",)))
        sink2 = Sink()
        reading = asyncio.ensure_future(collect(sink2.mux, script(("open", "c"), 5.0)))
        await asyncio.sleep(0.02)
        reading.cancel()  # the client went away
        await asyncio.gather(reading, return_exceptions=True)
        return sink.aborted + sink2.aborted

    assert run(main()) == [["b"], ["c"]]
