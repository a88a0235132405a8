"""The backend calls of one HTTP request, merged into one stream of deltas.

A batched completion has one call per prompt; choice ``index`` of prompt ``p``
is ``p * n + index`` (OpenAI's numbering). Waiting for the next delta can time
out without losing anything, which is what SSE keep-alives need; closing the
stream cancels every call, which is how a client disconnect reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Final

from gateway.backend import Delta, GenerateCall

# Returned by next() when nothing arrived within the timeout.
TIMED_OUT: Final = "timed_out"
_END: Final = "end"
# A slow HTTP client holds its Generate calls back (gRPC flow control) instead of
# letting the gateway buffer a whole generation. Requests multiplexed on a
# GenerateStream (--tokenizer-mux) share one flow-control window, so one slow
# client must not stall it: their deltas are buffered (at most max_tokens × n).
_QUEUE_SIZE = 64

_Item = tuple[int, Delta] | BaseException | str


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class DeltaStream:
    """Merged deltas of the calls. Each delta costs a deque append and, when the reader waits, one
    future and one timer (no task or ``asyncio.wait`` per delta: this runs once per token per request)."""

    def __init__(self, calls: Sequence[GenerateCall], n: int) -> None:
        self._calls = list(calls)
        self._n = n
        self._items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._open = len(self._calls)
        self._tasks = [asyncio.create_task(self._pump(i, c)) for i, c in enumerate(self._calls)]
        self._closed = False

    def _push(self, item: _Item) -> None:
        self._items.append(item)
        if len(self._items) >= _QUEUE_SIZE:
            self._room.clear()
        if self._waiter is not None:
            _wake(self._waiter)

    async def _pump(self, prompt_index: int, call: GenerateCall) -> None:
        try:
            async for delta in call:
                self._push((prompt_index, delta))
                if not self._room.is_set():
                    await self._room.wait()
        except Exception as err:  # handed to the reader, who owns the error handling
            self._push(err)
        else:
            self._push(_END)

    def choice_index(self, prompt_index: int, delta: Delta) -> int:
        return prompt_index * self._n + delta.index

    async def next(self, timeout: float | None = None) -> tuple[int, Delta] | str | None:
        """The next ``(prompt index, delta)``; ``TIMED_OUT`` after ``timeout`` seconds
        without one; ``None`` when every call has ended. Raises a call's error
        (after cancelling the others)."""
        while self._open:
            if not self._items:
                loop = asyncio.get_running_loop()
                self._waiter = waiter = loop.create_future()
                timer = loop.call_later(timeout, _wake, waiter) if timeout is not None else None
                try:
                    await waiter
                finally:
                    self._waiter = None
                    if timer is not None:
                        timer.cancel()
                if not self._items:
                    return TIMED_OUT
            item = self._items.popleft()
            if len(self._items) < _QUEUE_SIZE:
                self._room.set()
            if item == _END:
                self._open -= 1
            elif isinstance(item, BaseException):
                await self.aclose()
                raise item
            else:
                assert isinstance(item, tuple)
                return item
        return None

    async def aclose(self) -> None:
        """Cancel every call still running; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._open = 0
        for call in self._calls:
            call.cancel()
        if self._waiter is not None:
            self._waiter.cancel()
        waiting = [t for t in self._tasks if not t.done()]
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
