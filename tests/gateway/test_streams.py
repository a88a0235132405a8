"""DeltaStream: merging calls, keep-alive timeouts that lose nothing, errors, flow control, closing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.backend import Delta
from gateway.streams import _QUEUE_SIZE, TIMED_OUT, DeltaStream


class FakeCall:
    """Yields ``texts`` as deltas of sequence ``index``, waiting on ``gate`` before each when given."""

    def __init__(self, texts: list[str], *, index: int = 0, gate: asyncio.Queue[None] | None = None,
                 error: BaseException | None = None) -> None:
        self.texts = texts
        self.index = index
        self.gate = gate
        self.error = error
        self.cancelled = False
        self.produced = 0

    async def __aiter__(self) -> AsyncIterator[Delta]:
        for text in self.texts:
            if self.gate is not None:
                await self.gate.get()
            self.produced += 1
            yield Delta(index=self.index, text=text)
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True


async def _drain(stream: DeltaStream) -> list[tuple[int, int, str]]:
    out = []
    while (item := await stream.next()) is not None:
        assert isinstance(item, tuple)
        prompt, delta = item
        out.append((prompt, stream.choice_index(prompt, delta), delta.text))
    return out


def test_calls_are_merged_in_order_with_openai_choice_indexes() -> None:
    async def run() -> list[tuple[int, int, str]]:
        stream = DeltaStream([FakeCall(["a", "b", "c"], index=1), FakeCall(["x", "y"])], n=2)
        return await _drain(stream)

    got = asyncio.run(run())
    assert [t for p, _, t in got if p == 0] == ["a", "b", "c"]
    assert [t for p, _, t in got if p == 1] == ["x", "y"]
    assert {(p, i) for p, i, _ in got} == {(0, 1), (1, 2)}  # prompt p, sequence k -> p * n + k


def test_a_timeout_returns_timed_out_and_loses_nothing() -> None:
    async def run() -> list[object]:
        gate: asyncio.Queue[None] = asyncio.Queue()
        stream = DeltaStream([FakeCall(["late", "later"], gate=gate)], n=1)
        seen: list[object] = [await stream.next(timeout=0.05)]
        gate.put_nowait(None)
        item = await stream.next(timeout=1.0)
        seen.append(item[1].text if isinstance(item, tuple) else item)
        seen.append(await stream.next(timeout=0.05))
        gate.put_nowait(None)
        rest = await _drain(stream)
        seen.extend(t for _, _, t in rest)
        return seen

    assert asyncio.run(run()) == [TIMED_OUT, "late", TIMED_OUT, "later"]


def test_an_error_is_raised_after_what_came_before_and_cancels_the_other_calls() -> None:
    boom = RuntimeError("backend down")

    async def run() -> tuple[list[str], FakeCall]:
        other = FakeCall(["never"], gate=asyncio.Queue())
        stream = DeltaStream([FakeCall(["ok"], error=boom), other], n=1)
        texts = []
        with pytest.raises(RuntimeError, match="backend down"):
            while (item := await stream.next()) is not None:
                assert isinstance(item, tuple)
                texts.append(item[1].text)
        return texts, other

    texts, other = asyncio.run(run())
    assert texts == ["ok"] and other.cancelled


def test_a_reader_that_falls_behind_holds_the_call_back() -> None:
    async def run() -> tuple[int, list[str]]:
        call = FakeCall([str(i) for i in range(3 * _QUEUE_SIZE)])
        stream = DeltaStream([call], n=1)
        for _ in range(50):
            await asyncio.sleep(0)
        produced_unread = call.produced
        texts = [t for _, _, t in await _drain(stream)]
        return produced_unread, texts

    produced_unread, texts = asyncio.run(run())
    assert produced_unread == _QUEUE_SIZE  # the pump stops at the buffer's size until the reader catches up
    assert texts == [str(i) for i in range(3 * _QUEUE_SIZE)]


def test_aclose_cancels_every_call_and_wakes_nobody_twice() -> None:
    async def run() -> list[FakeCall]:
        calls = [FakeCall(["a"], gate=asyncio.Queue()), FakeCall(["b"], gate=asyncio.Queue())]
        stream = DeltaStream(calls, n=1)
        waiting = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.01)
        await stream.aclose()
        await stream.aclose()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await stream.next() is None
        return calls

    assert all(c.cancelled for c in asyncio.run(run()))
