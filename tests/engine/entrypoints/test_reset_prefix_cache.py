"""The engine's gRPC side of the prefix cache: ``cache_salt`` carried by Generate and Stream requests, and
``ResetPrefixCache`` (refused while a request holds blocks), read from the ``cached_tokens`` each request
reports. A tiny random Llama served in-process on a grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.grpc_server import new_server
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.grpc_servicer import SERVICE_NAME, EngineServicer
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.engine.core.tiny_llama import save_tiny_llama
from tests.procs import free_port

BS = 4
PROMPT = list(range(3, 20))   # 17 tokens: 16 of them can come from the cache


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    path: Path = tmp_path_factory.mktemp("tiny-reset")
    save_tiny_llama(path)
    eng = AsyncEngine(EngineCore(EngineConfig(model=str(path), dtype="float32", block_size=BS, num_kv_blocks=64,
                                              num_threads=1)))
    yield eng
    eng.shutdown()


def serve(engine: AsyncEngine, scenario: Any) -> Any:
    async def main() -> Any:
        server, _ = new_server(SERVICE_NAME, max_receive_bytes=16 * 2**20)
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await asyncio.wait_for(scenario(engine_pb2_grpc.EngineStub(channel)), 120)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def request(rid: str, salt: str = "", max_tokens: int = 2) -> engine_pb2.EngineGenerateRequest:
    req = engine_pb2.EngineGenerateRequest(
        request_id=rid, sampling=common_pb2.SamplingParameters(temperature=0.0), cache_salt=salt,
        stopping=engine_pb2.EngineStoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
    req.prompt_token_ids.ids.extend(PROMPT)
    return req


async def cached(stub: engine_pb2_grpc.EngineStub, rid: str, salt: str = "") -> int:
    """The prompt tokens a Generate call was told came from the cache."""
    return max([msg.cached_tokens async for msg in stub.Generate(request(rid, salt))])


async def reset(stub: engine_pb2_grpc.EngineStub) -> bool:
    return bool((await stub.ResetPrefixCache(common_pb2.ResetPrefixCacheRequest())).ok)


def test_generate_carries_the_salt_and_a_reset_forgets_every_block(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub) -> None:
        assert await reset(stub)
        assert await cached(stub, "a1", "alice") == 0
        assert await cached(stub, "b1", "bob") == 0
        assert await cached(stub, "u1") == 0
        assert await cached(stub, "a2", "alice") == 16
        assert await cached(stub, "u2") == 16
        assert await reset(stub)
        assert await cached(stub, "a3", "alice") == 0 and await cached(stub, "u3") == 0

    serve(engine, scenario)


def test_stream_requests_carry_the_salt(engine: AsyncEngine) -> None:
    async def outbox(*reqs: engine_pb2.EngineGenerateRequest) -> AsyncIterator[engine_pb2.EngineStreamRequest]:
        for r in reqs:
            yield engine_pb2.EngineStreamRequest(generate=r)

    async def scenario(stub: engine_pb2_grpc.EngineStub) -> None:
        assert await reset(stub)
        async for msg in stub.Stream(outbox(request("s1", "carol"))):
            if any(o.request_done for o in msg.outputs):
                break
        assert await cached(stub, "s2", "carol") == 16
        assert await cached(stub, "s3", "dave") == 0

    serve(engine, scenario)


def test_reset_is_refused_while_a_request_holds_blocks(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub) -> None:
        assert await cached(stub, "w1", "erin") in (0, 16)
        call = stub.Generate(request("long", max_tokens=200))
        await call.read()   # running: it holds its blocks
        assert not await reset(stub)
        assert await cached(stub, "w2", "erin") == 16   # nothing was forgotten
        call.cancel()
        for _ in range(100):   # the abort frees its blocks at the next step
            if await reset(stub):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the reset was still refused once the request ended")
        assert await cached(stub, "w3", "erin") == 0

    serve(engine, scenario)
