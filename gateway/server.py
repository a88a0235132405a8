"""The gateway's uvicorn server: HTTPS when configured, a bound on how long a client may take to send its
headers, and the drain of ``gateway/drain.py`` on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.config import LifespanType

from common.tls import RestTls
from gateway.drain import Drain
from gateway.linger import LingeringHttpToolsProtocol
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway")

# uvicorn's own grace once the drain is over: the last bytes of finished responses go out, and
# streams still running past --shutdown-timeout are cancelled (their backend calls with them).
GRACE_AFTER_DRAIN_SECONDS = 1


class DrainingServer(uvicorn.Server):
    """The first SIGTERM / SIGINT starts the drain instead of closing the listener; uvicorn's shutdown
    runs once it is finished. A second signal is uvicorn's own: exit now (a third forces it)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.begin(self.shutdown_timeout):
            log.info("draining: new requests get 503; %d in flight get %gs", self.drain.in_flight,
                     self.shutdown_timeout)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.finished():
            self.should_exit = True
        return await super().on_tick(counter)


def header_timeout_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (closing with a linger: ``gateway/linger.py``) that closes a connection whose
    request headers have not all arrived ``timeout`` seconds after it opened (or after the request's first byte,
    on a kept-alive connection). uvicorn has no header-read timeout: ``timeout_keep_alive`` is armed only after a
    response, so a client that opens connections and sends half a request line held each forever."""

    class HeaderTimeoutProtocol(LingeringHttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._header_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def build_server(app: ASGIApp, settings: GatewaySettings, drain: Drain, *, log_level: str = "info",
                 loop: str = "uvloop", lifespan: LifespanType = "auto") -> DrainingServer:
    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop=loop,
                            http=header_timeout_protocol(settings.header_read_timeout), log_level=log_level,
                            lifespan=lifespan, access_log=settings.access_log,
                            log_config=None,  # its lines go through ours (common/logs.py)
                            timeout_graceful_shutdown=GRACE_AFTER_DRAIN_SECONDS, server_header=False,
                            limit_concurrency=_limit_concurrency(settings.max_connections),
                            **_ssl_config(settings.rest_tls))
    return DrainingServer(config, drain, settings.shutdown_timeout)


def _limit_concurrency(max_connections: int | None) -> int | None:
    """uvicorn's limit for ``max_connections`` served at once: it counts the connection asking among the open ones
    and answers 503 once they reach the limit."""
    return None if max_connections is None else max_connections + 1


def _ssl_config(tls: RestTls | None) -> dict[str, Any]:
    """uvicorn's SSL arguments for ``tls`` (none: plain HTTP)."""
    if tls is None:
        return {}
    return {"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile, "ssl_ca_certs": tls.ca_certs,
            "ssl_cert_reqs": tls.cert_reqs}
