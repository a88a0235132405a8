"""SIGTERM drains the gateway: new requests get 503 + Retry-After and /ready 503 while in-flight
ones, streams included, finish within --shutdown-timeout; then the listener closes."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from tests.gateway.conftest import SERVED
from tests.gateway.fakes import FakeServer
from tests.gateway.test_error_matrix import check_error_body
from tests.gateway.test_hardening import Served, served

pytestmark = pytest.mark.anyio


async def _refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def _check_turned_away(gw: Served) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=5) as client:
        r = await client.post("/v1/completions", json={"model": SERVED, "prompt": "hello"})
        err = check_error_body(r, 503)
        assert err == {"message": "The server is shutting down. Retry on another server.",
                       "type": "service_unavailable_error", "param": None, "code": "shutting_down"}
        assert r.headers["retry-after"] == "1"
        assert r.headers["connection"] == "close"
        assert r.headers["x-request-id"]
        ready = await client.get("/ready")
        assert check_error_body(ready, 503)["code"] == "shutting_down"
        assert (await client.get("/health")).json() == {"status": "ok"}  # the process itself is fine


async def test_a_stream_in_flight_finishes_while_new_requests_get_503(fake_server: FakeServer) -> None:
    async with served(fake_server, shutdown_timeout=10) as gw, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10) as client:
        body = {"model": SERVED, "prompt": "gap:0.3", "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            first = await anext(lines)
            assert json.loads(first[6:])["choices"][0]["text"] == "Hel"
            gw.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
            assert gw.server.drain.draining and gw.server.drain.in_flight == 1
            await _check_turned_away(gw)
            assert not gw.task.done() and not await _refused(gw.port)  # still listening
            rest = [line async for line in lines if line]
        choices = [json.loads(line[6:])["choices"][0] for line in rest[:-1]]
        assert [(c["text"], c["finish_reason"]) for c in choices] == [("lo", None), (" world", "stop")]
        assert rest[-1] == "data: [DONE]"
        # Nothing left in flight: the server shuts down on its own and the port closes.
        await asyncio.wait_for(asyncio.shield(gw.task), 3)
        assert await _refused(gw.port)
    assert len(fake_server.servicer.generate_requests) == 1  # the 503 never reached the backend


async def test_a_stream_past_the_shutdown_timeout_is_cancelled(fake_server: FakeServer) -> None:
    async with served(fake_server, shutdown_timeout=0.3) as gw, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10) as client:
        body = {"model": SERVED, "prompt": "stall", "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            assert json.loads((await anext(lines))[6:])["choices"][0]["text"] == "Hel"
            loop = asyncio.get_running_loop()
            started = loop.time()
            gw.server.handle_exit(signal.SIGTERM, None)
            await asyncio.wait_for(asyncio.shield(gw.task), 5)
            # The drain's 0.3 s, then uvicorn's 1 s of grace before it cancels the stream.
            assert 1.2 < loop.time() - started < 3
            with pytest.raises(httpx.HTTPError):  # the response was cut short
                async for _ in lines:
                    pass
        await asyncio.wait_for(fake_server.servicer.cancelled.wait(), 5)  # and its backend call cancelled


async def test_with_nothing_in_flight_the_listener_closes_at_once(fake_server: FakeServer) -> None:
    async with served(fake_server, shutdown_timeout=10) as gw:
        gw.server.handle_exit(signal.SIGTERM, None)
        await asyncio.wait_for(asyncio.shield(gw.task), 2)
        assert await _refused(gw.port)
