"""One generation in flight for a dialect route: the OpenAI routes' :class:`Run` (the same backend calls,
metrics and error mapping), collected whole or framed as the dialect streams it.

A stream waits up to ``first_event_wait`` for its first event before it commits to a 200, as the OpenAI
routes do, so a request that fails fast (a full queue, a refused argument) gets its status and the
dialect's error body; after that a failure is the dialect's error frame, and the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from gateway.backend import Delta, FinishReason
from gateway.errors import ApiError, BackendError, internal_error
from gateway.routes.generate import Run, unless_disconnected
from gateway.sse import KEEPALIVE, SSEResponse
from gateway.streams import TIMED_OUT

log = logging.getLogger("gateway")


class Frames(Protocol):
    """How a dialect frames a stream: what each delta (already recorded in the run) becomes, what ends a
    finished stream, and the one frame that ends a failed one."""

    def delta(self, index: int, delta: Delta) -> list[str]: ...

    def end(self) -> list[str]: ...

    def error(self, err: ApiError) -> str: ...


async def collect(request: Request, run: Run) -> bool:
    """Every delta of the run, recorded; False when the client went away first (the calls are cancelled).
    A failed generation raises the dialect-neutral :class:`ApiError`."""
    async def read() -> None:
        while (item := await run.stream.next()) is not None:
            assert isinstance(item, tuple)
            run.record(*item)

    try:
        if not await unless_disconnected(request, read()):
            return False
        if run.failed():
            raise internal_error(run.rid)
        run.finish()
        return True
    except BackendError as err:
        raise run.api_error(err) from None
    finally:
        await run.close()


async def stream(run: Run, frames: Frames, response: type[SSEResponse] = SSEResponse) -> Response:
    """The run as ``response`` (server-sent events unless the dialect frames otherwise)."""
    try:
        first = await run.stream.next(timeout=run.state.settings.first_event_wait)
    except BackendError as err:
        await run.close()
        raise run.api_error(err) from None
    except BaseException:
        await run.close()
        raise
    return response(_frames(run, frames, first, keepalive=response is SSEResponse), on_close=run.close)


async def _frames(run: Run, frames: Frames, first: tuple[int, Delta] | str | None, *,
                  keepalive: bool) -> AsyncIterator[str]:
    interval = run.state.settings.keepalive_interval
    item = first
    try:
        while item is not None:
            if item == TIMED_OUT:
                if keepalive and interval is not None:  # else the first wait ran out: nothing to say
                    yield KEEPALIVE
            else:
                assert isinstance(item, tuple)
                prompt_index, delta = item
                index, _ = run.record(prompt_index, delta)
                if delta.finish_reason is FinishReason.ERROR:
                    yield frames.error(internal_error(run.rid))
                    return
                for frame in frames.delta(index, delta):
                    yield frame
            item = await run.stream.next(timeout=interval)
    except BackendError as err:
        log.warning("request %s: backend failed mid-stream: %s", run.rid, err)
        yield frames.error(run.api_error(err))
        return
    except Exception:
        log.exception("request %s: stream failed", run.rid)
        yield frames.error(internal_error(run.rid))
        return
    run.finish()
    for frame in frames.end():
        yield frame
