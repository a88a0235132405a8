"""``max_connections`` (``--max-connections``; a MindIE config's maxLinkNum): the gateway serves that many
connections at once, idle keep-alive ones included, and answers the next one's request 503 until one closes."""

from __future__ import annotations

import asyncio

import pytest

from gateway.settings import GatewaySettings
from tests.gateway.fakes import FakeServer
from tests.gateway.test_hardening import served

pytestmark = pytest.mark.anyio

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def _status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """The status of a GET /health sent on an open connection (its body read, the connection kept)."""
    writer.write(HEALTH)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
    return int(head.split(b" ")[1])


async def test_the_connection_past_the_cap_gets_503_until_one_closes(fake_server: FakeServer) -> None:
    async with served(fake_server, max_connections=2) as gw:
        first = await asyncio.open_connection("127.0.0.1", gw.port)
        second = await asyncio.open_connection("127.0.0.1", gw.port)
        assert [await _status(*first), await _status(*second)] == [200, 200]   # both kept open, idle
        third = await asyncio.open_connection("127.0.0.1", gw.port)
        assert await _status(*third) == 503
        assert await asyncio.wait_for(third[0].read(), 5) == b""   # uvicorn closes it
        first[1].close()
        await first[1].wait_closed()
        await asyncio.sleep(0.1)
        again = await asyncio.open_connection("127.0.0.1", gw.port)
        assert await _status(*again) == 200
        for _, writer in (second, again):
            writer.close()


async def test_without_a_cap_every_connection_is_served(fake_server: FakeServer) -> None:
    async with served(fake_server) as gw:
        connections = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(8)]
        assert [await _status(*c) for c in connections] == [200] * 8
        for _, writer in connections:
            writer.close()


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_connections must be >= 1"):
        GatewaySettings(max_connections=0)
