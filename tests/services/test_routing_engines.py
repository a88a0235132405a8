"""A tokenizer service in front of two engines (in process, with its tracker, against fake engines): requests go
in turn to the engines that are up, around one that is gone; the service is SERVING while either is, and a
restarted engine gets the shared-memory ring again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health_pb2_grpc

from common.grpc_server import bind
from proto.sluice.v1 import generation_pb2_grpc
from services.tokenizer.engines import Engine
from services.tokenizer.server import public_server, track_engines
from services.tokenizer.service import GenerationServicer
from tests.procs import free_port
from tests.services.test_slow_engine import (
    NOT_SERVING,
    SERVING,
    StallingEngine,
    _completed,
    _generate,
    _health,
    _tokenizer,
    _until,
    fake_engine,
)


async def _is(health: health_pb2_grpc.HealthStub, status: int) -> bool:
    return await _health(health) == status


@asynccontextmanager
async def two_engine_service(ports: list[int]) -> AsyncIterator[tuple[generation_pb2_grpc.GenerationStub,
                                                                      health_pb2_grpc.HealthStub, GenerationServicer]]:
    engines = [Engine(grpc.aio.insecure_channel(f"127.0.0.1:{p}"), f"127.0.0.1:{p}") for p in ports]
    server, health_service = public_server(_tokenizer(), 4096, ())
    servicer = GenerationServicer(_tokenizer(), engines, served_model_name="fake", shm_tokens=1024)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    await health_service.set_serving(False)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    tracker = asyncio.ensure_future(track_engines(servicer, health_service, asyncio.Event()))
    client = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield generation_pb2_grpc.GenerationStub(client), health_pb2_grpc.HealthStub(client), servicer
    finally:
        tracker.cancel()
        await client.close()
        await server.stop(0)
        servicer.close()
        for e in engines:
            await e.channel.close()


def test_requests_alternate_over_the_engines_up_and_go_around_one_that_is_gone() -> None:
    async def main() -> None:
        a, b = StallingEngine(), StallingEngine()
        ports = [free_port(), free_port()]
        async with two_engine_service(ports) as (stub, health, servicer):
            async with fake_engine(a, ports[0]):
                async with fake_engine(b, ports[1]):
                    await _until(lambda: _true(all(e.up for e in servicer.engines)), 10, "both engines up")
                    assert await _is(health, SERVING)
                    # Arriving together (before either engine has our ring): each sees the others' choices.
                    results = await asyncio.gather(*(_generate(stub, f"c{i}") for i in range(6)))
                    assert all(_completed(r) for r in results)
                    assert (len(a.first_tokens), len(b.first_tokens)) == (3, 3)
                    results = [await _generate(stub, f"r{i}") for i in range(4)]
                    assert all(_completed(r) for r in results)
                    assert (len(a.first_tokens), len(b.first_tokens)) == (5, 5)   # no cache known: in turn
                    async with servicer.engine_for([1, 2, 3]) as held:
                        chosen = next(e for e in servicer.engines if e.stub is held)
                        assert chosen.open_requests == 1
                    assert chosen.open_requests == 0
                await _until(lambda: _true(not servicer.engines[1].up), 5, "engine b seen gone")
                assert await _is(health, SERVING)   # a is still there
                results = [await _generate(stub, f"s{i}") for i in range(4)]
                assert all(_completed(r) for r in results) and len(a.first_tokens) == 9
                restarted = StallingEngine()   # a new process on b's port
                async with fake_engine(restarted, ports[1]):
                    await _until(lambda: _true(servicer.engines[1].up), 10, "engine b back")
                    results = [await _generate(stub, f"t{i}") for i in range(4)]
                    assert all(_completed(r) for r in results)
                    assert (len(a.first_tokens), len(restarted.first_tokens)) == (11, 2)
                    assert (b.registrations, restarted.registrations) == (1, 1)   # the new process got our ring
            await _until(lambda: _is(health, NOT_SERVING), 5, "NOT_SERVING with neither engine")

    asyncio.run(main())


async def _true(value: bool) -> bool:
    return value
