"""A slow engine is not a dead one: the tokenizer service with its engine tracker (in process) in front of a
fake engine that stalls longer than the old 10 s GetInfo deadline, one that goes away and comes back, and a
real engine process SIGSTOPped with requests in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import bind
from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.tokenizer.migration import MigrationSettings
from services.tokenizer.server import SERVICE_NAME, public_server, track_engines
from services.tokenizer.service import GenerationServicer
from tests.procs import free_port, grpc_serving, spawn, stop, tokenizer_process, wait_until

TOKENS = [100, 101, 102, 103, 104, 105]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StallingEngine(engine_pb2_grpc.EngineServicer):
    """Streams ``TOKENS`` to every request, one per step of ``step`` seconds. Cleared ``running``: GetInfo and
    every step wait, as they do in a stopped or starved process (its connection stays up)."""

    def __init__(self, step: float = 0.02) -> None:
        self.step = step
        self.running = asyncio.Event()
        self.running.set()
        self.stream_calls = 0
        self.registrations = 0
        self.first_tokens: set[str] = set()  # requests that got their first token
        self.instance_id = uuid.uuid4().hex  # a new one: a restarted engine

    async def GetInfo(self, request: Any, context: grpc.aio.ServicerContext) -> engine_pb2.GetInfoResponse:
        await self.running.wait()
        return engine_pb2.GetInfoResponse(model_name="fake", max_model_len=4096, vocab_size=49152,
                                          eos_token_ids=[2], bos_token_id=1, block_size=16,
                                          instance_id=self.instance_id)

    async def RegisterSharedMemory(self, request: Any, context: grpc.aio.ServicerContext
                                   ) -> engine_pb2.RegisterSharedMemoryResponse:
        self.registrations += 1
        return engine_pb2.RegisterSharedMemoryResponse(ok=True)  # the ids are not read: any will do

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        return engine_pb2.AbortResponse()

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineStreamRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        self.stream_calls += 1
        await context.send_initial_metadata(())  # as the engine does: the client waits for it
        out: asyncio.Queue[engine_pb2.EngineStreamResponse] = asyncio.Queue()
        runs: list[asyncio.Future[None]] = []

        async def run(request: engine_pb2.EngineGenerateRequest) -> None:
            for i, token in enumerate(TOKENS):
                await asyncio.sleep(self.step)
                await self.running.wait()
                last = i == len(TOKENS) - 1
                out.put_nowait(engine_pb2.EngineStreamResponse(outputs=[engine_pb2.EngineGenerateResponse(
                    request_id=request.request_id, token_ids=[token], prompt_tokens=2, request_done=last,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)]))
                self.first_tokens.add(request.request_id)

        async def read() -> None:
            async for msg in request_iterator:
                if msg.HasField("generate"):
                    runs.append(asyncio.ensure_future(run(msg.generate)))

        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for r in runs:
                r.cancel()


@asynccontextmanager
async def fake_engine(servicer: StallingEngine, port: int) -> AsyncIterator[grpc.aio.Server]:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


@asynccontextmanager
async def tokenizer_service(engine_port: int) -> AsyncIterator[tuple[generation_pb2_grpc.GenerationStub,
                                                                     health_pb2_grpc.HealthStub, GenerationServicer]]:
    """The tokenizer service as ``serve`` wires it (shared memory on, the tracker running), and stubs to it."""
    engine_channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}")
    server, health_service = public_server(_tokenizer(), 4096, ())
    # Migration off: these requests fail with their engine, as they do without a replica to move to
    # (tests/services/test_migration.py has them wait for one).
    servicer = GenerationServicer(_tokenizer(), engine_channel, served_model_name="fake",
                                  shm_tokens=1024, migration=MigrationSettings(max_migrations=0))
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
        await engine_channel.close()


_TOKENIZER: list[Tokenizer] = []


def _tokenizer() -> Tokenizer:
    if not _TOKENIZER:
        _TOKENIZER.append(Tokenizer.from_pretrained(default_model_path()))
    return _TOKENIZER[0]


async def _health(health: health_pb2_grpc.HealthStub) -> int:
    return int((await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)).status)


async def _until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


async def _generate(stub: generation_pb2_grpc.GenerationStub, rid: str) -> list[generation_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(generation_pb2.GenerateRequest(text="hi", request_id=rid))]


def _completed(responses: list[generation_pb2.GenerateResponse]) -> bool:
    return (len(responses) == len(TOKENS) and responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            and responses[-1].usage.completion_tokens == len(TOKENS))


def test_an_engine_stalled_past_the_old_getinfo_deadline_keeps_every_stream_and_stays_ready() -> None:
    """Steps and GetInfo both stall 12 s (a SIGSTOP, or ~10 s steps under contention): before, the tracker
    took the GetInfo timeout for a restart and reset the engine stream, failing every request with 503."""

    async def main() -> None:
        engine, port = StallingEngine(), free_port()
        async with fake_engine(engine, port), tokenizer_service(port) as (stub, health, _):
            await _until(lambda: _is(health, SERVING), 10, "SERVING")
            streams = [asyncio.ensure_future(_generate(stub, f"r{i}")) for i in range(4)]
            await _until(lambda: _true(len(engine.first_tokens) == 4), 10, "first tokens")
            registered = engine.registrations
            engine.running.clear()
            seen: set[int] = set()
            stalled_until = time.monotonic() + 12
            while time.monotonic() < stalled_until:
                seen.add(await _health(health))  # the tokenizer's own health answers at once
                await asyncio.sleep(0.5)
            assert not any(s.done() for s in streams)
            engine.running.set()
            results = await asyncio.wait_for(asyncio.gather(*streams), 10)
            assert [_completed(r) for r in results] == [True] * 4
            assert seen == {SERVING}
            # Nothing was taken for a restart: the one call lived on, the ring was not handed over again.
            assert (engine.stream_calls, engine.registrations) == (1, registered)

    asyncio.run(main())


def test_an_engine_that_is_gone_fails_its_requests_at_once_and_a_new_one_gets_our_ring_again() -> None:
    async def main() -> None:
        first, port = StallingEngine(step=0.2), free_port()
        async with tokenizer_service(port) as (stub, health, _):
            async with fake_engine(first, port):
                await _until(lambda: _is(health, SERVING), 10, "SERVING")
                stream = asyncio.ensure_future(_generate(stub, "r0"))
                await _until(lambda: _true(bool(first.first_tokens)), 10, "first token")
                gone_at = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(stream, 5)
            assert time.monotonic() - gone_at < 1.0
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            await _until(lambda: _is(health, NOT_SERVING), 2, "NOT_SERVING")
            second = StallingEngine()
            async with fake_engine(second, port):
                await _until(lambda: _is(health, SERVING), 10, "SERVING again")
                assert _completed(await asyncio.wait_for(_generate(stub, "r0"), 10))
                assert (first.registrations, second.registrations) == (1, 1)  # the new engine got the ring
                assert second.stream_calls == 1

    asyncio.run(main())


def test_a_restart_seen_late_never_ends_the_call_already_open_on_the_new_engine() -> None:
    """The tracker learns of a restart after the fact; a request may have opened a call on the new engine
    by then, and that call must live on."""

    async def main() -> None:
        engine, port = StallingEngine(step=0.1), free_port()
        async with fake_engine(engine, port), tokenizer_service(port) as (stub, health, servicer):
            await _until(lambda: _is(health, SERVING), 10, "SERVING")
            stream = asyncio.ensure_future(_generate(stub, "r0"))
            await _until(lambda: _true(bool(engine.first_tokens)), 10, "first token")
            servicer.engine_restarted()
            assert _completed(await asyncio.wait_for(stream, 10))
            assert engine.stream_calls == 1

    asyncio.run(main())


def test_the_same_engine_reached_again_keeps_our_ring() -> None:
    """A dropped connection to the same engine process (its instance id unchanged) is not a restart: before
    instance ids, any new connection was taken for a new engine and the ring handed over again."""

    async def main() -> None:
        engine, port = StallingEngine(), free_port()
        async with tokenizer_service(port) as (stub, health, _):
            async with fake_engine(engine, port):
                await _until(lambda: _is(health, SERVING), 10, "SERVING")
                assert _completed(await asyncio.wait_for(_generate(stub, "r0"), 10))
            await _until(lambda: _is(health, NOT_SERVING), 5, "NOT_SERVING")
            async with fake_engine(engine, port):
                await _until(lambda: _is(health, SERVING), 10, "SERVING again")
                assert _completed(await asyncio.wait_for(_generate(stub, "r1"), 10))
            assert engine.registrations == 1

    asyncio.run(main())


def test_a_changed_instance_id_on_a_connection_that_stayed_up_is_a_restart() -> None:
    """Behind a proxy the connection outlives the engine: the id in GetInfo is what tells."""

    async def main() -> None:
        engine, port = StallingEngine(), free_port()
        async with fake_engine(engine, port), tokenizer_service(port) as (stub, health, _):
            await _until(lambda: _is(health, SERVING), 10, "SERVING")
            assert _completed(await asyncio.wait_for(_generate(stub, "r0"), 10))
            assert engine.registrations == 1
            engine.instance_id = uuid.uuid4().hex
            await asyncio.sleep(2.5)  # the tracker asks every second; nothing is sent meanwhile
            assert _completed(await asyncio.wait_for(_generate(stub, "r1"), 10))
            assert engine.registrations == 2

    asyncio.run(main())


async def _is(health: health_pb2_grpc.HealthStub, status: int) -> bool:
    return await _health(health) == status


async def _true(value: bool) -> bool:
    return value


@pytest.mark.slow
def test_a_real_engine_sigstopped_past_the_old_deadline_finishes_its_four_requests(tmp_path: Path) -> None:
    port = free_port()
    engine = spawn(["-m", "engine", "--port", str(port), "--dtype", "float32", "--max-num-seqs", "4",
                    "--kv-cache-memory", "256MiB"], tmp_path / "engine.log")
    addr = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: grpc_serving(addr, "sluice.v1.Engine"), 300, engine, "engine ready")
        with tokenizer_process(tmp_path, addr) as tok_addr:
            stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(tok_addr))
            received = [0] * 4
            results: list[generation_pb2.GenerateResponse | BaseException | None] = [None] * 4

            def generate(i: int) -> None:
                stopping = generation_pb2.StoppingCriteria(max_tokens=48, ignore_eos=True)
                try:
                    for r in stub.Generate(generation_pb2.GenerateRequest(text=f"Story {i}:", stopping=stopping),
                                           timeout=120):
                        received[i] += 1
                        results[i] = r
                except Exception as e:  # noqa: BLE001 — the assertion below shows it
                    results[i] = e

            threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            wait_until(lambda: min(received) >= 2, 60, what="all four streaming")
            os.kill(engine.pid, signal.SIGSTOP)
            try:
                time.sleep(12)
                assert [isinstance(r, generation_pb2.GenerateResponse) for r in results] == [True] * 4
                assert grpc_serving(tok_addr, "sluice.v1.Generation")  # stalled, not dead
            finally:
                os.kill(engine.pid, signal.SIGCONT)
            for t in threads:
                t.join(60)
            finals = [r.finish_reason if isinstance(r, generation_pb2.GenerateResponse) else r for r in results]
            assert finals == [common_pb2.FINISH_REASON_LENGTH] * 4
            assert [r.usage.completion_tokens for r in results] == [48] * 4  # type: ignore[union-attr]
    finally:
        stop(engine)
