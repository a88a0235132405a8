"""Lingering close: a response sent while the request's body is still arriving (413 for a body over the limit, or
any refusal with ``Connection: close`` sent before the body was read) reaches the client. Closing the socket with
unread bytes in its receive buffer makes the kernel send a reset, which discards the response the client has not
read yet: a client that sends its whole body before it reads (most do) saw "connection reset" instead of the 413.
So the connection is half-closed instead (FIN after the response), and what the client still sends is read and
dropped, up to ``LINGER_MAX_BYTES`` and ``LINGER_MAX_SECONDS``, until it stops sending for ``LINGER_IDLE_SECONDS``
or closes its side (Apache's ``lingering_close``, nginx's ``lingering_time`` / ``lingering_timeout``)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

LINGER_MAX_BYTES = 64 * 2**20  # past this much the connection is closed outright (a reset)
LINGER_MAX_SECONDS = 10.0
LINGER_IDLE_SECONDS = 2.0


class _CycleTransport:
    """The transport as a request's cycle sees it: its ``close`` is the protocol's lingering close."""

    def __init__(self, protocol: LingeringHttpToolsProtocol, transport: asyncio.Transport) -> None:
        self._protocol = protocol
        self._transport = transport

    def close(self) -> None:
        self._protocol.close_lingering()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class LingeringHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing with a linger when the request's body has not all arrived."""

    _lingering = False
    _linger_bytes = 0
    _linger_last = 0.0
    _linger_deadline = 0.0
    _linger_timer: asyncio.TimerHandle | None = None

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and not isinstance(self.cycle.transport, _CycleTransport):
            self.cycle.transport = _CycleTransport(self, self.cycle.transport)  # type: ignore[assignment]

    def close_lingering(self) -> None:
        """Closes now, unless the response went out while the body is still arriving: then half-closes and
        drains, within the caps."""
        if self._lingering or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.more_body:
            self.transport.close()
            return
        self._lingering = True
        if self.transport.can_write_eof():  # TLS cannot half-close: the response's Content-Length ends it there
            self.transport.write_eof()  # after the response's bytes: the client reads it, then end of stream
        self.flow.resume_reading()
        now = self.loop.time()
        self._linger_last, self._linger_deadline = now, now + LINGER_MAX_SECONDS
        self._linger_timer = self.loop.call_later(LINGER_IDLE_SECONDS, self._linger_check)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            super().data_received(data)
            return
        self._linger_bytes += len(data)
        self._linger_last = self.loop.time()
        if self._linger_bytes > LINGER_MAX_BYTES:
            self._end_linger()

    def eof_received(self) -> None:
        if self._lingering:
            self._end_linger()
            return
        super().eof_received()

    def on_response_complete(self) -> None:
        if self._lingering:  # no keep-alive and no pipelined request on a connection that is closing
            self.server_state.total_requests += 1
            return
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def _linger_check(self) -> None:
        self._linger_timer = None
        now = self.loop.time()
        if now >= self._linger_deadline or now - self._linger_last >= LINGER_IDLE_SECONDS:
            self._end_linger()
            return
        wait = min(self._linger_deadline, self._linger_last + LINGER_IDLE_SECONDS) - now
        self._linger_timer = self.loop.call_later(wait, self._linger_check)

    def _end_linger(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if not self.transport.is_closing():
            self.transport.close()
