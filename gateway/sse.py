"""Server-sent events: framing, keep-alive comments, and a response that always
cleans up after itself (the backend calls are cancelled however the stream ends).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
# A comment line: ignored by SSE parsers (the openai SDK included), but it keeps
# proxies and load balancers from closing an idle connection while a request
# waits in the queue or a long prompt is prefilled.
KEEPALIVE = ": keep-alive\n\n"


def event(data: object) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response; ``on_close`` runs when the stream ends for any
    reason: finished, client gone (Starlette cancels the iterator) or server error."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterable[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        # no-transform / X-Accel-Buffering: proxies must pass events on as they come.
        base = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"}
        super().__init__(content, headers={**base, **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
