"""Request migration in the tokenizer service (services/tokenizer/migration.py), against fake engines in process:
a request whose engine dies mid-stream goes on from a live one, sent as prompt + delivered tokens with
``resumed_output_tokens``, and its client sees every token once and one end; with no live replica it fails once with
UNAVAILABLE after its wait; with migration off it fails as it did before; each move is counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from common.grpc_server import bind
from proto.sluice.v1 import common_pb2, engine_pb2, generation_pb2, generation_pb2_grpc
from services.tokenizer.engines import Engine
from services.tokenizer.migration import MigrationMetrics, MigrationSettings
from services.tokenizer.server import public_server, track_engines
from services.tokenizer.service import GenerationServicer
from tests.procs import free_port
from tests.services.test_slow_engine import TOKENS, StallingEngine, _tokenizer, _until, fake_engine


def sequence(seed: int) -> list[int]:
    """What the fake engine streams for a sequence seeded ``seed`` (0 when unseeded): ``TOKENS`` (the letters
    t..y) shifted by the seed's last digit, ending after 2 tokens when the seed is odd."""
    return [t + seed % 10 for t in TOKENS][:2 if seed % 2 else None]


class ResumingEngine(StallingEngine):
    """Streams ``sequence(seed + i)`` for each sequence i of a request as the engine contract says: a request
    resumed after K tokens gets the rest. With ``stall_after``, a request stops there and waits (the test then
    kills the engine)."""

    def __init__(self, stall_after: int | None = None) -> None:
        super().__init__(step=0.01)
        self.stall_after = stall_after
        self.received: list[engine_pb2.EngineGenerateRequest] = []
        self.aborted: list[engine_pb2.AbortRequest] = []
        self.stalled = asyncio.Event()

    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> engine_pb2.AbortResponse:
        self.aborted.append(request)
        return engine_pb2.AbortResponse()

    async def Stream(self, request_iterator: AsyncIterator[engine_pb2.EngineStreamRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        await context.send_initial_metadata(())
        out: asyncio.Queue[engine_pb2.EngineStreamResponse] = asyncio.Queue()

        async def run(request: engine_pb2.EngineGenerateRequest) -> None:
            self.received.append(request)
            seed = request.sampling.seed if request.sampling.HasField("seed") else 0
            seqs = [sequence(seed + i) for i in range(request.n or 1)]
            for k in range(request.resumed_output_tokens, len(TOKENS)):
                if k == self.stall_after:
                    self.stalled.set()
                    await asyncio.Event().wait()
                await asyncio.sleep(self.step)
                done = all(k >= len(s) - 1 for s in seqs)
                out.put_nowait(engine_pb2.EngineStreamResponse(outputs=[engine_pb2.EngineGenerateResponse(
                    request_id=request.request_id, index=i, token_ids=[s[k]], request_done=done and i == len(seqs) - 1,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if k == len(s) - 1 else 0)
                    for i, s in enumerate(seqs) if k < len(s)]))
                if done:
                    return

        async def read() -> None:
            async for msg in request_iterator:
                if msg.HasField("generate"):
                    runs.append(asyncio.ensure_future(run(msg.generate)))

        runs: list[asyncio.Future[None]] = []
        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for r in runs:
                r.cancel()


@asynccontextmanager
async def service(ports: list[int], settings: MigrationSettings
                  ) -> AsyncIterator[tuple[generation_pb2_grpc.GenerationStub, GenerationServicer]]:
    """A tokenizer service over engines at ``ports`` (inline prompt ids: the fake engines read them)."""
    engines = [Engine(grpc.aio.insecure_channel(f"127.0.0.1:{p}"), f"127.0.0.1:{p}") for p in ports]
    server, health = public_server(_tokenizer(), 4096, ())
    servicer = GenerationServicer(_tokenizer(), engines, served_model_name="fake", shm_tokens=0,
                                  migration=settings, migration_metrics=MigrationMetrics())
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    tracker = asyncio.ensure_future(track_engines(servicer, health, asyncio.Event()))
    client = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield generation_pb2_grpc.GenerationStub(client), servicer
    finally:
        tracker.cancel()
        await client.close()
        await server.stop(0)
        servicer.close()
        for e in engines:
            await e.channel.close()


async def _true(value: bool) -> bool:
    return value


async def read(stub: generation_pb2_grpc.GenerationStub, out: list[generation_pb2.GenerateResponse],
               n: int = 1, seed: int | None = None, stop: tuple[str, ...] = ()) -> None:
    request = generation_pb2.GenerateRequest(text="hi", request_id="moving", n=n,
                                             sampling=common_pb2.SamplingParameters(temperature=1.0, seed=seed),
                                             stopping=generation_pb2.StoppingCriteria(stop=stop))
    async for r in stub.Generate(request):
        out.append(r)


def moved(servicer: GenerationServicer) -> float:
    value: Any = servicer.migration_metrics.registry.get_sample_value("sluice:requests_migrated_total")
    return float(value)


def test_a_request_whose_engine_dies_goes_on_from_a_live_one() -> None:
    async def main() -> None:
        a, b = ResumingEngine(stall_after=3), ResumingEngine()
        ports = [free_port(), free_port()]
        async with service(ports, MigrationSettings()) as (stub, servicer):
            async with fake_engine(a, ports[0]) as server_a:
                await _until(lambda: _true(servicer.engines[0].up), 10, "engine a up")
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(read(stub, got))   # to a: b is not up yet
                async with fake_engine(b, ports[1]):
                    await _until(lambda: _true(servicer.engines[1].up), 10, "engine b up")
                    await asyncio.wait_for(a.stalled.wait(), 10)
                    await server_a.stop(0)   # a dies after 3 tokens
                    await asyncio.wait_for(reading, 10)
                    first, resumed = a.received[0], b.received[0]
                    prompt = list(first.prompt_token_ids.ids)
                    assert resumed.resumed_output_tokens == 3
                    assert list(resumed.prompt_token_ids.ids) == prompt + TOKENS[:3]
                    assert resumed.request_id != first.request_id and resumed.sampling == first.sampling
                    assert resumed.client_request_id == "moving"
        assert [t for r in got for t in r.token_ids] == TOKENS
        assert [r.finish_reason for r in got if r.finish_reason] == [common_pb2.FINISH_REASON_LENGTH]
        assert got[-1].usage.completion_tokens == len(TOKENS) and got[-1].usage.prompt_tokens == len(prompt)
        assert moved(servicer) == 1.0
        assert [e.open_requests for e in servicer.engines] == [0, 0]

    asyncio.run(main())


@pytest.mark.parametrize("max_migrations", [2, 0])
def test_with_no_live_replica_or_migration_off_the_request_fails_once(max_migrations: int) -> None:
    async def main() -> None:
        a = ResumingEngine(stall_after=2)
        port = free_port()
        async with service([port], MigrationSettings(max_migrations=max_migrations, wait_s=0.5)) as (stub, servicer):
            async with fake_engine(a, port) as server_a:
                await _until(lambda: _true(servicer.engines[0].up), 10, "engine a up")
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(read(stub, got))
                await asyncio.wait_for(a.stalled.wait(), 10)
                await server_a.stop(0)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await asyncio.wait_for(reading, 10)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        if max_migrations:
            assert "no live replica took the request within" in (e.value.details() or "")
        assert [t for r in got for t in r.token_ids] == TOKENS[:2]
        assert not any(r.finish_reason for r in got)
        assert moved(servicer) == 0.0 and len(a.received) == 1

    asyncio.run(main())


def test_with_no_live_replica_the_request_waits_for_its_engine_to_restart() -> None:
    async def main() -> None:
        a, restarted = ResumingEngine(stall_after=4), ResumingEngine()
        port = free_port()
        async with service([port], MigrationSettings(wait_s=10)) as (stub, servicer):
            async with fake_engine(a, port) as server_a:
                await _until(lambda: _true(servicer.engines[0].up), 10, "engine a up")
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(read(stub, got))
                await asyncio.wait_for(a.stalled.wait(), 10)
                await server_a.stop(0)
            await asyncio.sleep(0.3)   # down for a while: the request waits
            assert not reading.done()
            async with fake_engine(restarted, port):   # a new process on the same address
                await asyncio.wait_for(reading, 10)
        assert [t for r in got for t in r.token_ids] == TOKENS
        assert restarted.received[0].resumed_output_tokens == 4
        assert moved(servicer) == 1.0

    asyncio.run(main())


@pytest.mark.parametrize("seed", [10, None])
def test_a_request_with_n_3_moves_each_unfinished_sequence_as_its_own_resumed_request(seed: int | None) -> None:
    async def main() -> None:
        a, b = ResumingEngine(stall_after=3), ResumingEngine()
        ports = [free_port(), free_port()]
        async with service(ports, MigrationSettings()) as (stub, servicer):
            async with fake_engine(a, ports[0]) as server_a:
                await _until(lambda: _true(servicer.engines[0].up), 10, "engine a up")
                got: list[generation_pb2.GenerateResponse] = []
                reading = asyncio.ensure_future(read(stub, got, n=3, seed=seed))   # to a: b is not up yet
                async with fake_engine(b, ports[1]):
                    await _until(lambda: _true(servicer.engines[1].up), 10, "engine b up")
                    await asyncio.wait_for(a.stalled.wait(), 10)
                    await server_a.stop(0)   # a dies after 3 tokens of each sequence
                    await asyncio.wait_for(reading, 10)
        first, base = a.received[0], seed or 0
        prompt = list(first.prompt_token_ids.ids)
        if seed is None:   # unseeded: it goes on, with no promise of the same tokens (here: seed 0's)
            assert first.n == 3 and not first.sampling.HasField("seed")
            assert [(r.n, r.sampling.HasField("seed"), r.resumed_output_tokens) for r in b.received] == [
                (1, False, 3)] * 2
            assert [len([t for r in got if r.index == i for t in r.token_ids]) for i in range(3)] == [6, 2, 6]
            return
        # Sequence 1 (seed 11) ended after 2 tokens on a; sequences 0 and 2 went on from b as n = 1 requests.
        assert [(r.n, r.best_of, r.sampling.seed, r.resumed_output_tokens, list(r.prompt_token_ids.ids))
                for r in b.received] == [(1, 0, seed, 3, prompt + sequence(seed)[:3]),
                                         (1, 0, seed + 2, 3, prompt + sequence(seed + 2)[:3])]
        assert len({r.request_id for r in [first, *b.received]}) == 3
        assert all(r.client_request_id == "moving" and r.sampling.temperature == 1.0 for r in b.received)
        for i in range(3):
            assert [t for r in got if r.index == i for t in r.token_ids] == sequence(base + i), i
            assert [r.finish_reason for r in got if r.index == i and r.finish_reason] == [
                common_pb2.FINISH_REASON_LENGTH]
        assert got[-1].usage.completion_tokens == 6 + 2 + 6 and got[-1].usage.prompt_tokens == len(prompt)
        assert moved(servicer) == 1.0
        assert [e.open_requests for e in servicer.engines] == [0, 0]

    asyncio.run(main())


def test_a_stop_string_after_the_move_ends_its_sequence_and_aborts_only_its_request() -> None:
    """n = 3 moved as two n = 1 requests (sequences 0 and 2); a stop string then ends sequence 2 here: its own
    engine request is aborted, sequence 0 goes on to its end, and the stream ends (no wait for the aborted one)."""
    async def main() -> None:
        a, b = ResumingEngine(stall_after=3), ResumingEngine()
        ports = [free_port(), free_port()]
        async with service(ports, MigrationSettings()) as (stub, servicer):
            async with fake_engine(a, ports[0]) as server_a:
                await _until(lambda: _true(servicer.engines[0].up), 10, "engine a up")
                got: list[generation_pb2.GenerateResponse] = []
                # Sequence 2 (seed 12) is "vwxyz{": "z", its 5th token, comes from b; sequences 0 and 1 have none.
                reading = asyncio.ensure_future(read(stub, got, n=3, seed=10, stop=("z",)))
                async with fake_engine(b, ports[1]):
                    await _until(lambda: _true(servicer.engines[1].up), 10, "engine b up")
                    await asyncio.wait_for(a.stalled.wait(), 10)
                    await server_a.stop(0)
                    await asyncio.wait_for(reading, 10)
                    await _until(lambda: _true(bool(b.aborted)), 10, "the abort at b")
        assert [r.request_ids for r in b.aborted] == [[b.received[1].request_id]]   # sequence 2's, whole
        assert ["".join(r.text for r in got if r.index == i) for i in range(3)] == ["tuvwxy", "uv", "vwxy"]
        length, stop = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP_STRING
        assert [[r.finish_reason for r in got if r.index == i and r.finish_reason] for i in range(3)] == [
            [length], [length], [stop]]
        assert [e.open_requests for e in servicer.engines] == [0, 0]

    asyncio.run(main())
