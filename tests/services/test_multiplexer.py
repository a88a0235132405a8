"""``GenerateStream``'s multiplexer in one event loop, with a stand-in servicer: the orderings a real
socket rarely produces (a cancel in the same turn as its request, a deadline, errors), each request
ending with exactly one end item."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from common.errors import InvalidRequestError
from proto.sluice.v1 import generation_pb2
from services.tokenizer.multiplexer import Multiplexer as _Multiplexer


class StandIn:
    """What the multiplexer needs of GenerationServicer: ``draining`` and ``generate``."""

    def __init__(self) -> None:
        self.draining = False
        self.started: list[str] = []
        self.closed: list[str] = []

    async def generate(self, request: generation_pb2.GenerateRequest, request_id: str, *, timeout: float | None
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.started.append(request.text)
        try:
            if request.text == "bad":
                raise InvalidRequestError("temperature", "must be >= 0")
            n = 3 if request.text != "forever" else 10**9
            for i in range(n):
                if i:
                    await asyncio.sleep(0.01)  # a step
                yield generation_pb2.GenerateResponse(request_id=request_id, text=f"{request.text}{i}")
        finally:
            self.closed.append(request.text)


def gen(id_: int, text: str, timeout_ms: int = 0) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(id=id_, generate=generation_pb2.GenerateRequest(text=text),
                                                timeout_ms=timeout_ms)


def cancel(id_: int) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(id=id_, cancel=True)


async def requests(*msgs: generation_pb2.GenerateStreamRequest, hold: float = 0.0
                   ) -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
    for m in msgs:
        yield m  # no await in between: several actions in one turn of the loop
    await asyncio.sleep(hold)  # then half-close


async def collect(servicer: StandIn, source: AsyncIterator[generation_pb2.GenerateStreamRequest], *,
                  reused: frozenset[int] = frozenset()
                  ) -> tuple[dict[int, list[generation_pb2.GenerateStreamItem]], int]:
    """Items by id; an item after its id's end fails, unless the id is in ``reused`` (started again)."""
    by_id: dict[int, list[generation_pb2.GenerateStreamItem]] = {}
    messages = 0
    async for message in _Multiplexer(servicer).run(source):  # type: ignore[arg-type]
        messages += 1
        for item in message.items:
            if item.id not in reused:
                assert not (by_id.get(item.id) and by_id[item.id][-1].end), f"item for {item.id} after its end"
            by_id.setdefault(item.id, []).append(item)
    return by_id, messages


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_requests_end_once_each_with_their_status_and_the_stream_ends_after_half_close() -> None:
    servicer = StandIn()
    got, messages = run(collect(servicer, requests(gen(1, "a"), gen(2, "bad"), gen(3, "c"))))
    assert [i.response.text for i in got[1] if i.HasField("response")] == ["a0", "a1", "a2"]
    assert got[1][-1].end and got[1][-1].status_code == 0
    assert got[1][-1].HasField("response")  # the end rides on the last delta when it had not left yet
    assert [(i.end, i.status_code) for i in got[2]] == [(True, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert got[2][0].status_message == "temperature: must be >= 0"
    assert got[3][-1].status_code == 0
    assert messages <= 4  # the three requests' deltas of one step travel together


def test_a_cancel_in_the_same_turn_as_its_request_ends_it_before_it_ever_ran() -> None:
    servicer = StandIn()
    got, _ = run(collect(servicer, requests(gen(1, "forever"), cancel(1), gen(2, "b"), cancel(9))))
    assert [(i.end, i.status_code) for i in got[1]] == [(True, grpc.StatusCode.CANCELLED.value[0])]
    assert "forever" not in servicer.started
    assert got[2][-1].status_code == 0 and 9 not in got


def test_cancel_and_deadline_of_running_requests_close_their_generation() -> None:
    servicer = StandIn()

    async def source() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        yield gen(1, "forever")
        yield gen(2, "forever", timeout_ms=50)
        await asyncio.sleep(0.1)
        yield cancel(1)
        await asyncio.sleep(0.05)
        yield gen(1, "a")  # an ended id is free again

    got, _ = run(collect(servicer, source(), reused=frozenset({1})))
    ends = [i for i in got[1] if i.end]
    assert [i.status_code for i in ends] == [grpc.StatusCode.CANCELLED.value[0], 0]
    assert got[2][-1].status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert servicer.closed.count("forever") == 2  # both generations were closed (the engine call aborted)


def test_an_open_id_started_again_fails_the_stream_and_aborts_what_is_open() -> None:
    servicer = StandIn()

    async def source() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        yield gen(4, "forever")
        await asyncio.sleep(0.05)
        yield gen(4, "forever")
        await asyncio.sleep(10)

    with pytest.raises(InvalidRequestError, match="still open"):
        run(collect(servicer, source()))
    assert servicer.closed == ["forever"]


def test_draining_refuses_new_requests_and_ends_without_a_half_close() -> None:
    servicer = StandIn()

    async def source() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
        yield gen(1, "a")
        await asyncio.sleep(0.005)
        servicer.draining = True
        yield gen(2, "b")
        await asyncio.sleep(3600)  # never half-closes

    async def go() -> tuple[dict[int, list[generation_pb2.GenerateStreamItem]], int]:
        mux = _Multiplexer(servicer)  # type: ignore[arg-type]
        by_id: dict[int, list[generation_pb2.GenerateStreamItem]] = {}
        async for message in mux.run(source()):
            for item in message.items:
                by_id.setdefault(item.id, []).append(item)
            if servicer.draining:
                mux.wake()  # what GenerationServicer.drain does
        return by_id, 0

    got, _ = run(go())
    assert got[1][-1].status_code == 0 and len([i for i in got[1] if i.HasField("response")]) == 3
    assert [(i.status_code, i.status_message) for i in got[2]] == [
        (grpc.StatusCode.UNAVAILABLE.value[0], "the tokenizer service is shutting down")]
