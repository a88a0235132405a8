"""Every client reads its 413 (issue 44, part 4): bodies of 2-50 MB over a 1 MiB limit, sent by httpx's async
client and by aiohttp, to the gateway as ``python -m gateway`` serves it (its uvicorn protocol), beside a stream
that keeps running. Before the lingering close the gateway closed the socket with the body's rest unread, the
kernel answered the client's next bytes with a reset, and the client saw "connection reset" instead of the 413."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from common.tls import RestTls
from tests.gateway.conftest import SERVED
from tests.gateway.fakes import FakeServer
from tests.gateway.test_hardening import served
from tests.tls_factory import make_ca, make_cert

pytestmark = pytest.mark.anyio

LIMIT = 2**20
SIZES_MB = [2 + (48 * i) // 19 for i in range(20)]  # 20 bodies of 2 … 50 MB from each client
MESSAGE = f"The request body is larger than {LIMIT} bytes, this server's limit."


def body_of(size: int) -> bytes:
    head = json.dumps({"model": SERVED, "prompt": ""})[:-2].encode()
    return head + b"x" * (size - len(head) - 2) + b'"}'


def check_413(status: int, text: str) -> None:
    assert status == 413, text[:200]
    assert json.loads(text) == {"error": {"message": MESSAGE, "type": "invalid_request_error", "param": None,
                                          "code": "request_too_large"}}


async def via_httpx(url: str, size: int, chunked: bool, verify: ssl.SSLContext | bool = True) -> None:
    data = body_of(size)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 2**16):
            yield data[i:i + 2**16]

    async with httpx.AsyncClient(base_url=url, timeout=30, verify=verify) as client:
        r = await client.post("/v1/completions", content=chunks() if chunked else data,
                              headers={"Content-Type": "application/json"})
        check_413(r.status_code, r.text)


async def via_aiohttp(url: str, size: int, context: ssl.SSLContext | None = None) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/v1/completions", data=body_of(size), headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=30), ssl=context if context is not None else True) as r:
        check_413(r.status, await r.text())


async def streams(url: str, stop: asyncio.Event) -> tuple[int, float]:
    """Streams one after another until ``stop``: (streams completed, the longest wait for a chunk, seconds)."""
    done, longest = 0, 0.0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            async with client.stream("POST", "/v1/completions", json={"model": SERVED, "prompt": "gap:0.05",
                                                                      "stream": True}) as r:
                assert r.status_code == 200
                last = time.perf_counter()
                lines = []
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    longest, last = max(longest, now - last), now
                    if line:
                        lines.append(line)
                assert lines[-1] == "data: [DONE]"
            done += 1
    return done, longest


async def test_over_limit_bodies_read_their_413_on_every_client_beside_a_running_stream(
        fake_server: FakeServer) -> None:
    async with served(fake_server, max_body_bytes=LIMIT) as gw:
        url = f"http://127.0.0.1:{gw.port}"
        stop = asyncio.Event()
        stream = asyncio.create_task(streams(url, stop))
        sends = [via_httpx(url, mb * 10**6, chunked=i % 3 == 2) for i, mb in enumerate(SIZES_MB)]
        sends += [via_aiohttp(url, mb * 10**6) for mb in SIZES_MB]
        sem = asyncio.Semaphore(4)

        async def bounded(call: object) -> None:
            async with sem:
                await call  # type: ignore[misc]

        try:
            await asyncio.gather(*(bounded(c) for c in sends))
        finally:
            stop.set()
            completed, longest = await stream
        assert completed >= 1
        assert longest < 1.0  # the stream's chunks kept coming (0.05 s apart) while the bodies were drained


async def test_over_https_every_client_reads_its_413_too(fake_server: FakeServer, tmp_path: Path) -> None:
    """TLS cannot half-close, so the rest of the body is drained without it; a handful of sizes (not 20)."""
    ca = make_ca(tmp_path)
    cert = make_cert(tmp_path, ca, "gateway")
    context = ssl.create_default_context(cafile=str(ca.cert))
    tls = RestTls(certfile=str(cert.cert), keyfile=str(cert.key), ca_certs=None, cert_reqs=ssl.CERT_NONE)
    async with served(fake_server, max_body_bytes=LIMIT, rest_tls=tls) as gw:
        url = f"https://127.0.0.1:{gw.port}"
        for mb in (2, 20, 50):
            await via_httpx(url, mb * 10**6, chunked=False, verify=context)
            await via_aiohttp(url, mb * 10**6, context)
