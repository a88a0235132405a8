"""The tokenizer service's EngineStream against scripted engines on 127.0.0.1: demultiplexing, errors with
Generate's status codes, a broken call, and the fallback to Generate for an engine without Stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from common.grpc_errors import retry_after_s
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2
from services.tokenizer.engine_stream import EngineStream, error_reason
from services.tokenizer.multiplexer import Multiplexer
from tests.procs import free_port

FINAL = common_pb2.FINISH_REASON_LENGTH


def _req(rid: str) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(request_id=rid, prompt_token_ids=common_pb2.TokenIds(ids=[1, 2]))


def _out(rid: str, tok: int, last: bool = False) -> engine_pb2.EngineGenerateResponse:
    return engine_pb2.EngineGenerateResponse(request_id=rid, token_ids=[tok], request_done=last,
                                             finish_reason=FINAL if last else 0)


class ScriptedStreamEngine(engine_pb2_grpc.EngineServicer):
    """Answers Stream calls from ``script(requests, calls)``: an async generator of responses."""

    def __init__(self, script: Callable[[AsyncIterator[Any], ScriptedStreamEngine], AsyncIterator[Any]]) -> None:
        self.script = script
        self.calls = 0
        self.received: list[engine_pb2.EngineStreamRequest] = []
        self.incoming: asyncio.Queue[engine_pb2.EngineStreamRequest] = asyncio.Queue()

    async def Stream(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        self.calls += 1
        await context.send_initial_metadata(())  # as the engine does: the client waits for it

        async def pump() -> None:
            async for msg in request_iterator:
                self.received.append(msg)
                self.incoming.put_nowait(msg)

        reader = asyncio.ensure_future(pump())
        try:
            async for msg in self.script(context, self):
                yield msg
        finally:
            reader.cancel()


class GenerateOnlyEngine(engine_pb2_grpc.EngineServicer):
    """An older engine: Generate only (Stream is UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.generate_calls = 0

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.generate_calls += 1
        yield engine_pb2.EngineGenerateResponse(token_ids=[7])
        yield engine_pb2.EngineGenerateResponse(token_ids=[8], finish_reason=FINAL)


def run(servicer: engine_pb2_grpc.EngineServicer, scenario: Callable[[EngineStream], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = EngineStream(engine_pb2_grpc.EngineStub(channel))
                try:
                    return await asyncio.wait_for(scenario(stream), 30)
                finally:
                    stream.close()
        finally:
            await server.stop(0)

    return asyncio.run(main())


async def _tokens(stream: EngineStream, rid: str) -> list[int]:
    return [t async for m in stream.generate(_req(rid)) for t in m.token_ids]


def test_outputs_reach_their_request_even_after_another_left_early() -> None:
    async def script(context: Any, eng: ScriptedStreamEngine) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        ids = []
        while len(ids) < 2:  # both requests arrived
            ids.append((await eng.incoming.get()).generate.request_id)
        yield engine_pb2.EngineStreamResponse(outputs=[_out("a", 1), _out("b", 1)])
        abort = await eng.incoming.get()  # "a" left early
        assert list(abort.abort.request_ids) == ["a"]
        # Its terminal output still comes (as from a real engine), then "b" goes on in shared messages.
        yield engine_pb2.EngineStreamResponse(outputs=[_out("a", 2, last=True), _out("b", 2)])
        yield engine_pb2.EngineStreamResponse(outputs=[_out("b", 3, last=True)])
        await asyncio.sleep(30)

    async def scenario(stream: EngineStream) -> tuple[list[int], list[int]]:
        first_a: list[int] = []

        async def a() -> None:
            gen = stream.generate(_req("a"))
            first_a.extend((await anext(gen)).token_ids)
            await gen.aclose()  # leaves early (what the tokenizer service does): aborts over the call

        results = await asyncio.gather(a(), _tokens(stream, "b"))
        return first_a, results[1]

    eng = ScriptedStreamEngine(script)
    first_a, b = run(eng, scenario)
    assert first_a == [1] and b == [1, 2, 3]
    assert eng.calls == 1  # both requests on one call


def test_a_refused_request_raises_the_status_generate_would_have() -> None:
    async def script(context: Any, eng: ScriptedStreamEngine) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        await eng.incoming.get()
        yield engine_pb2.EngineStreamResponse(errors=[engine_pb2.EngineRequestError(
            request_id="q", code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="the queue is full")])
        await eng.incoming.get()
        yield engine_pb2.EngineStreamResponse(outputs=[_out("ok", 5, last=True)])
        await asyncio.sleep(30)

    async def scenario(stream: EngineStream) -> tuple[grpc.StatusCode, str, list[int]]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _tokens(stream, "q")
        return err.value.code(), err.value.details(), await _tokens(stream, "ok")

    code, details, ok = run(ScriptedStreamEngine(script), scenario)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and details == "the queue is full"
    assert ok == [5]  # the call is still good for the next request


def test_an_overloaded_engines_retry_hint_survives_the_stream_and_the_multiplexer() -> None:
    """The engine's estimate (EngineRequestError.retry_after_s) becomes the ``retry-after`` trailer a Generate
    call would carry, and GenerateStream's end item carries it as retry_after_seconds (the gateway's
    Retry-After, whichever way it talks to the service)."""
    async def script(context: Any, eng: ScriptedStreamEngine) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        while True:
            rid = (await eng.incoming.get()).generate.request_id
            error = engine_pb2.EngineRequestError(request_id=rid, message="overloaded",
                                                  code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            if rid.startswith("busy"):
                error.retry_after_s = 7
            yield engine_pb2.EngineStreamResponse(errors=[error])

    class Service:
        draining = False

        def __init__(self, stream: EngineStream) -> None:
            self.stream = stream

        async def generate(self, request: Any, request_id: str, *, timeout: float | None
                           ) -> AsyncIterator[generation_pb2.GenerateResponse]:
            async for _ in self.stream.generate(_req(request_id)):
                yield generation_pb2.GenerateResponse()

    async def scenario(stream: EngineStream) -> tuple[list[int | None], list[int]]:
        hints = []
        for rid in ("busy", "full"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _tokens(stream, rid)
            hints.append(retry_after_s(err.value))
        mux = Multiplexer(Service(stream))  # type: ignore[arg-type]

        async def requests() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
            yield generation_pb2.GenerateStreamRequest(id=1, generate=generation_pb2.GenerateRequest(
                request_id="busy-2"))

        ends = [item.retry_after_seconds async for message in mux.run(requests()) for item in message.items
                if item.end and item.status_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
        return hints, ends

    hints, ends = run(ScriptedStreamEngine(script), scenario)
    assert hints == [7, None]
    assert ends == [7]


def test_a_refusal_keeps_its_typed_reason() -> None:
    async def script(context: Any, eng: ScriptedStreamEngine) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        for rid, reason in (("lost", engine_pb2.ERROR_REASON_SHM_NOT_REGISTERED),
                            ("plain", engine_pb2.ERROR_REASON_UNSPECIFIED)):
            await eng.incoming.get()
            yield engine_pb2.EngineStreamResponse(errors=[engine_pb2.EngineRequestError(
                request_id=rid, code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="refused", reason=reason)])
        await asyncio.sleep(30)

    async def scenario(stream: EngineStream) -> list[tuple[grpc.StatusCode, int]]:
        got = []
        for rid in ("lost", "plain"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _tokens(stream, rid)
            got.append((err.value.code(), error_reason(err.value)))
        return got

    assert run(ScriptedStreamEngine(script), scenario) == [
        (grpc.StatusCode.INVALID_ARGUMENT, engine_pb2.ERROR_REASON_SHM_NOT_REGISTERED),
        (grpc.StatusCode.INVALID_ARGUMENT, engine_pb2.ERROR_REASON_UNSPECIFIED)]


def test_a_broken_call_fails_its_requests_and_the_next_request_opens_a_new_call() -> None:
    async def script(context: Any, eng: ScriptedStreamEngine) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        msg = await eng.incoming.get()
        rid = msg.generate.request_id
        if eng.calls == 1:
            await eng.incoming.get()
            yield engine_pb2.EngineStreamResponse(outputs=[_out("x", 1)])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine going down")
        yield engine_pb2.EngineStreamResponse(outputs=[_out(rid, 9, last=True)])
        await asyncio.sleep(30)

    async def scenario(stream: EngineStream) -> tuple[list[Any], list[int]]:
        outcomes = await asyncio.gather(_tokens(stream, "x"), _tokens(stream, "y"), return_exceptions=True)
        return [o.code() if isinstance(o, grpc.aio.AioRpcError) else o for o in outcomes], await _tokens(stream, "z")

    eng = ScriptedStreamEngine(script)
    outcomes, z = run(eng, scenario)
    assert outcomes == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    assert z == [9] and eng.calls == 2


def test_a_request_id_already_running_on_the_call_is_refused_locally() -> None:
    async def script(context: Any, eng: ScriptedStreamEngine) -> AsyncIterator[engine_pb2.EngineStreamResponse]:
        await eng.incoming.get()
        await asyncio.sleep(0.3)
        yield engine_pb2.EngineStreamResponse(outputs=[_out("d", 4, last=True)])
        await asyncio.sleep(30)

    async def scenario(stream: EngineStream) -> tuple[Any, ...]:
        first = asyncio.ensure_future(_tokens(stream, "d"))
        await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _tokens(stream, "d")
        return err.value.code(), await first

    eng = ScriptedStreamEngine(script)
    code, first = run(eng, scenario)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and first == [4]
    assert sum(m.HasField("generate") for m in eng.received) == 1  # the duplicate never reached the engine


def test_an_engine_without_stream_is_served_by_generate_calls() -> None:
    async def scenario(stream: EngineStream) -> tuple[list[list[int]], list[int], bool | None]:
        # Three requests race to the first Stream call; all of them, and the next, fall back to Generate.
        first = await asyncio.gather(*(_tokens(stream, rid) for rid in ("p", "q", "r")))
        return first, await _tokens(stream, "s"), stream.supported

    eng = GenerateOnlyEngine()
    first, later, supported = run(eng, scenario)
    assert first == [[7, 8]] * 3 and later == [7, 8]
    assert supported is False and eng.generate_calls == 4
