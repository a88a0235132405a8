"""The backend calls of one HTTP request, merged into one stream of deltas.

A batched completion has one call per prompt; choice ``index`` of prompt ``p``
is ``p * n + index`` (OpenAI's numbering). Waiting for the next delta can time
out without losing anything, which is what SSE keep-alives need; closing the
stream cancels every call, which is how a client disconnect reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

from gateway.backend import Delta, GenerateCall

# Returned by next() when nothing arrived within the timeout.
TIMED_OUT: Final = "timed_out"
_END: Final = "end"
# A slow HTTP client holds the calls back (gRPC flow control) instead of
# letting the gateway buffer a whole generation.
_QUEUE_SIZE = 64


class DeltaStream:
    def __init__(self, calls: Sequence[GenerateCall], n: int) -> None:
        self._calls = list(calls)
        self._n = n
        self._queue: asyncio.Queue[tuple[int, Delta] | BaseException | str] = asyncio.Queue(_QUEUE_SIZE)
        self._open = len(self._calls)
        self._pending: asyncio.Future[tuple[int, Delta] | BaseException | str] | None = None
        self._tasks = [asyncio.create_task(self._pump(i, c)) for i, c in enumerate(self._calls)]
        self._closed = False

    async def _pump(self, prompt_index: int, call: GenerateCall) -> None:
        try:
            async for delta in call:
                await self._queue.put((prompt_index, delta))
        except Exception as err:  # handed to the reader, who owns the error handling
            await self._queue.put(err)
        else:
            await self._queue.put(_END)

    def choice_index(self, prompt_index: int, delta: Delta) -> int:
        return prompt_index * self._n + delta.index

    async def next(self, timeout: float | None = None) -> tuple[int, Delta] | str | None:
        """The next ``(prompt index, delta)``; ``TIMED_OUT`` after ``timeout`` seconds
        without one; ``None`` when every call has ended. Raises a call's error
        (after cancelling the others)."""
        while self._open:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._queue.get())
            done, _ = await asyncio.wait({self._pending}, timeout=timeout)
            if not done:
                return TIMED_OUT
            item = self._pending.result()
            self._pending = None
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
        waiting = [t for t in self._tasks if not t.done()]
        if self._pending is not None:
            waiting.append(self._pending)  # type: ignore[arg-type]
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
