"""Fixtures: a fake Generation server, and the gateway served by a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.client import GrpcBackend
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from tests.gateway.fakes import FakeGeneration, FakeServer, start_fake_server

SERVED = "sluice-test"
API_KEY = "sk-test-key"


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
async def one_event_loop() -> AsyncIterator[None]:
    """Held for the whole session by every fixture that starts gRPC objects, so that anyio runs those
    tests in one event loop. grpc.aio binds its completion-queue poller to each loop that uses it, and
    with a loop per test it sometimes posted a finished call's event to an earlier test's closed loop:
    "RuntimeError: Event loop is closed" from ``PollerCompletionQueue._handle_events`` failed the setup
    of an unrelated test (grpc/grpc#25364 is the same binding, across threads).

    Tests elsewhere that run grpc.aio in loops of their own (``asyncio.run``) can still leave grpc's poller
    posting a late event of theirs to their closed loop from this one: that exact error, raised in grpc's
    ``_handle_events`` callback, is grpc's and is dropped here; every other exception goes to the handler
    that was set (anyio's, which fails the test)."""
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
                and "_handle_events" in repr(context.get("handle"))):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    yield


@dataclasses.dataclass
class Gateway:
    url: str
    client: httpx.AsyncClient  # no key unless the test sends one
    fake: FakeServer
    metrics: GatewayMetrics
    settings: GatewaySettings

    @property
    def backend_calls(self) -> FakeGeneration:
        return self.fake.servicer


@contextlib.asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn (httptools) on a free 127.0.0.1 port, in this loop."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="warning", http="httptools", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


GatewayFactory = Callable[..., contextlib.AbstractAsyncContextManager[Gateway]]


@pytest.fixture
async def fake_server(one_event_loop: None) -> AsyncIterator[FakeServer]:
    fake = await start_fake_server()
    yield fake
    await fake.server.stop(0)


@pytest.fixture(params=[False, True], ids=["calls", "mux"])
def tokenizer_mux(request: pytest.FixtureRequest) -> bool:
    """Every gateway test runs both ways: a Generate call per request, and multiplexed on GenerateStream."""
    return bool(request.param)


@pytest.fixture
def make_gateway(fake_server: FakeServer, tokenizer_mux: bool) -> GatewayFactory:
    """``async with make_gateway(**settings) as gw`` — a gateway in front of the fake server."""

    @contextlib.asynccontextmanager
    async def factory(*, live: bool = False, **overrides: Any) -> AsyncIterator[Gateway]:
        """By default the app is called in-process (httpx's ASGI transport: fast, whole
        responses only); ``live=True`` serves it with uvicorn on a socket, for timing,
        incremental streaming and disconnects."""
        values: dict[str, Any] = {"tokenizer_addresses": (fake_server.address,), "served_model_names": (SERVED,),
                                  "keepalive_interval": 0.2, "tokenizer_mux": tokenizer_mux}
        values.update(overrides)
        settings = GatewaySettings(**values)
        backend = GrpcBackend.connect(settings.tokenizer_addresses, mux=settings.tokenizer_mux)
        metrics = GatewayMetrics()
        app = create_app(settings, backend, metrics)
        try:
            if not live:
                url = "http://gateway.test"
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=url) as client:
                    yield Gateway(url, client, fake_server, metrics, settings)
            else:
                async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
                    yield Gateway(url, client, fake_server, metrics, settings)
        finally:
            await backend.close()

    return factory


@pytest.fixture
async def gateway(make_gateway: GatewayFactory) -> AsyncIterator[Gateway]:
    async with make_gateway() as gw:
        yield gw


@pytest.fixture
async def live_gateway(make_gateway: GatewayFactory) -> AsyncIterator[Gateway]:
    async with make_gateway(live=True) as gw:
        yield gw
