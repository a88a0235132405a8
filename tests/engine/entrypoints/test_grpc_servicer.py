"""Engine.Stream: many requests over one call, one message per step, one terminal event per request, and
nothing left running when the call ends. The servicer runs in-process on a grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from common.grpc_server import MAX_MESSAGE_BYTES, new_server
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.grpc_servicer import SERVICE_NAME, EngineServicer
from engine.entrypoints.model_limits import engine_max_request_bytes
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.procs import free_port

pytestmark = pytest.mark.slow

Scenario = Callable[[engine_pb2_grpc.EngineStub, AsyncEngine], Awaitable[Any]]


@pytest.fixture(scope="module")
def engine() -> AsyncEngine:
    eng = AsyncEngine(EngineCore(EngineConfig(dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1)))
    yield eng
    eng.shutdown()


def serve(engine: AsyncEngine, scenario: Scenario) -> Any:
    """Run ``scenario(stub, engine)`` against an engine server on 127.0.0.1 in this process."""

    async def main() -> Any:
        server, _ = new_server(SERVICE_NAME, max_receive_bytes=engine_max_request_bytes(engine.core.max_model_len))
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await asyncio.wait_for(scenario(engine_pb2_grpc.EngineStub(channel), engine), 120)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def _request(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> engine_pb2.EngineGenerateRequest:
    req = engine_pb2.EngineGenerateRequest(request_id=rid, sampling=common_pb2.SamplingParameters(temperature=0.0),
                                           stopping=engine_pb2.EngineStoppingCriteria(max_tokens=max_tokens,
                                                                                      ignore_eos=True), **kw)
    req.prompt_token_ids.ids.extend(prompt)
    return req


def _gen(req: engine_pb2.EngineGenerateRequest) -> engine_pb2.EngineStreamRequest:
    return engine_pb2.EngineStreamRequest(generate=req)


class Outbox:
    """The caller's side of a Stream call: messages queued here are sent in order; close() half-closes."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[engine_pb2.EngineStreamRequest | None] = asyncio.Queue()

    def send(self, msg: engine_pb2.EngineStreamRequest) -> None:
        self._queue.put_nowait(msg)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[engine_pb2.EngineStreamRequest]:
        while (msg := await self._queue.get()) is not None:
            yield msg


async def _idle(engine: AsyncEngine) -> dict[str, Any]:
    for _ in range(200):
        info = await engine.call(lambda core: core.info())
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            break
        await asyncio.sleep(0.02)
    return info


PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16]}


def test_requests_share_one_message_per_step_and_match_generate(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> tuple[Any, ...]:
        alone = {rid: [t async for m in stub.Generate(_request(rid + "-alone", p, 6)) for t in m.token_ids]
                 for rid, p in PROMPTS.items()}
        outbox = Outbox()
        for rid, p in PROMPTS.items():
            outbox.send(_gen(_request(rid, p, 6)))
        outbox.close()
        messages = [m async for m in stub.Stream(outbox)]  # the call ends once every request has
        counters = (await stub.GetInfo(engine_pb2.GetInfoRequest())).counters
        return alone, messages, counters

    alone, messages, counters = serve(engine, scenario)
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    done: dict[str, int] = {rid: 0 for rid in PROMPTS}
    for msg in messages:
        assert not msg.errors
        assert len({o.request_id for o in msg.outputs}) == len(msg.outputs)  # one entry per request per step
        for out in msg.outputs:
            assert done[out.request_id] == 0, "nothing comes after a request's last message"
            tokens[out.request_id].extend(out.token_ids)
            done[out.request_id] += out.request_done
            assert out.request_done == (out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED)
    assert done == {rid: 1 for rid in PROMPTS}
    assert tokens == alone  # greedy, fp32: the same tokens as one Generate call each
    # Decode steps ran the three together: their outputs came in shared messages, not one message each.
    assert any(len(m.outputs) == 3 for m in messages)
    assert len(messages) < sum(len(t) for t in tokens.values())
    assert counters.stream_calls >= 1


def test_stream_interval_groups_each_requests_tokens_over_stream_and_generate(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> tuple[Any, ...]:
        alone = [t async for m in stub.Generate(_request("one-by-one", PROMPTS["a"], 10)) for t in m.token_ids]
        grouped = [list(m.token_ids) async for m in stub.Generate(_request("grouped", PROMPTS["a"], 10,
                                                                           stream_interval=4))]
        outbox = Outbox()
        for rid, p in PROMPTS.items():
            outbox.send(_gen(_request(rid, p, 10, stream_interval=4)))
        outbox.close()
        messages = [m async for m in stub.Stream(outbox)]
        return alone, grouped, messages, await _idle(eng)

    alone, grouped, messages, info = serve(engine, scenario)
    # The first token at once, then groups of 4, then the rest with the finish reason: the same tokens.
    assert [len(g) for g in grouped] == [1, 4, 4, 1]
    assert [t for g in grouped for t in g] == alone
    per_request: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for msg in messages:
        for out in msg.outputs:
            per_request[out.request_id].append(len(out.token_ids))
    assert per_request == {rid: [1, 4, 4, 1] for rid in PROMPTS}
    assert info["free_kv_blocks"] == info["total_kv_blocks"]


@pytest.mark.parametrize("bad, code, text", [
    (dict(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (dict(sampling=common_pb2.SamplingParameters(temperature=-1.0)), grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    (dict(prompt_shm=engine_pb2.SharedMemoryRef(segment="nope", length=3)), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt_shm"),
    (dict(prompt_token_ids=common_pb2.TokenIds(ids=[5] * 100_000)), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(stream_interval=0), grpc.StatusCode.INVALID_ARGUMENT, "stream_interval"),
])
def test_a_refused_request_gets_one_error_and_the_others_go_on(engine: AsyncEngine, bad: dict[str, Any],
                                                                code: grpc.StatusCode, text: str) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> list[engine_pb2.EngineStreamResponse]:
        outbox = Outbox()
        outbox.send(_gen(_request("good", [5, 6, 7], 3)))
        req = _request("bad", [5, 6, 7], 3)
        for field, value in bad.items():
            if isinstance(value, str | int | float):
                setattr(req, field, value)
            else:
                getattr(req, field).CopyFrom(value)
        outbox.send(_gen(req))
        outbox.send(_gen(_request("good2", [8, 9], 3)))
        outbox.close()
        return [m async for m in stub.Stream(outbox)]

    messages = serve(engine, scenario)
    errors = [e for m in messages for e in m.errors]
    assert len(errors) == 1
    assert errors[0].request_id == ("" if "request_id" in bad else "bad")
    assert errors[0].code == code.value[0] and text in errors[0].message
    # Only the refusal a caller acts on (register its segment again) carries a typed reason.
    assert errors[0].reason == (engine_pb2.ERROR_REASON_SHM_NOT_REGISTERED if "prompt_shm" in bad
                                else engine_pb2.ERROR_REASON_UNSPECIFIED)
    finished = [o.request_id for m in messages for o in m.outputs if o.request_done]
    assert sorted(finished) == ["good", "good2"]


def test_generate_refusing_an_unregistered_segment_names_the_reason_in_its_trailers(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> grpc.aio.AioRpcError:
        req = _request("shm", [5, 6], 3)
        req.prompt_shm.CopyFrom(engine_pb2.SharedMemoryRef(segment="nope", length=2))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(req):
                pass
        return err.value

    err = serve(engine, scenario)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "prompt_shm" in err.details()
    assert ("sluice-error-reason", "ERROR_REASON_SHM_NOT_REGISTERED") in tuple(err.trailing_metadata())


def test_duplicate_id_on_one_call_is_refused_and_the_first_runs_on(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> list[engine_pb2.EngineStreamResponse]:
        outbox = Outbox()
        outbox.send(_gen(_request("same", [5, 6, 7], 4)))
        outbox.send(_gen(_request("same", [8, 9], 4)))
        outbox.close()
        return [m async for m in stub.Stream(outbox)]

    messages = serve(engine, scenario)
    errors = [e for m in messages for e in m.errors]
    assert [(e.request_id, e.code) for e in errors] == [("same", grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    outputs = [o for m in messages for o in m.outputs]
    assert sum(len(o.token_ids) for o in outputs) == 4 and outputs[-1].request_done


def test_abort_over_the_call_ends_the_request_and_frees_its_blocks(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> tuple[Any, ...]:
        outbox = Outbox()
        call = stub.Stream(outbox)
        outbox.send(_gen(_request("long", [5, 6, 7], 500)))
        outbox.send(_gen(_request("short", [8, 9], 3)))
        seen: list[engine_pb2.EngineGenerateResponse] = []
        aborted = False
        async for msg in call:
            seen.extend(msg.outputs)
            if not aborted and sum(len(o.token_ids) for o in seen if o.request_id == "long") >= 2:
                outbox.send(engine_pb2.EngineStreamRequest(abort=engine_pb2.AbortRequest(request_ids=["long",
                                                                                                      "other"])))
                outbox.close()
                aborted = True
        info = await _idle(eng)
        return seen, info

    seen, info = serve(engine, scenario)
    last = {o.request_id: o for o in seen if o.request_done}
    assert last["long"].finish_reason == common_pb2.FINISH_REASON_ABORTED
    assert last["short"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(o.token_ids) for o in seen if o.request_id == "long") < 500
    assert info["free_kv_blocks"] == info["total_kv_blocks"]


@pytest.mark.parametrize("path", ["stream", "generate"])
def test_aborting_one_sequence_of_n_ends_it_alone_and_the_request_is_done_once(engine: AsyncEngine,
                                                                                 path: str) -> None:
    # n = 3 sampled sequences; index 1 is aborted over gRPC once it has tokens (through the Abort RPC on a
    # Generate call, through the call's own abort message on Stream): it ends ABORTED, its siblings run to
    # max_tokens, and the engine says once, on the request's last message, that the request is done.
    max_tokens = 64
    request = _request("n3", [5, 6, 7, 8], max_tokens, n=3)
    request.sampling.CopyFrom(common_pb2.SamplingParameters(temperature=1.0, seed=11))
    abort = engine_pb2.AbortRequest(sequences=[engine_pb2.SequenceRef(request_id="n3", index=1)])

    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> tuple[Any, ...]:
        outputs: list[engine_pb2.EngineGenerateResponse] = []
        outbox = Outbox()
        if path == "stream":
            outbox.send(_gen(request))
            messages = (o async for m in stub.Stream(outbox) for o in m.outputs)
        else:
            messages = stub.Generate(request).__aiter__()
        aborted = False
        async for out in messages:
            outputs.append(out)
            if not aborted and sum(len(o.token_ids) for o in outputs if o.index == 1) >= 2:
                aborted = True
                if path == "stream":
                    outbox.send(engine_pb2.EngineStreamRequest(abort=abort))
                    outbox.close()  # half-closed: the call ends once its request is done
                else:
                    await stub.Abort(abort)
        info = await _idle(eng)
        return outputs, info, await stub.GetInfo(engine_pb2.GetInfoRequest())

    outputs, info, grpc_info = serve(engine, scenario)
    finals = {o.index: o.finish_reason for o in outputs if o.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED}
    assert finals == {0: common_pb2.FINISH_REASON_LENGTH, 1: common_pb2.FINISH_REASON_ABORTED,
                      2: common_pb2.FINISH_REASON_LENGTH}
    tokens = {i: sum(len(o.token_ids) for o in outputs if o.index == i) for i in range(3)}
    assert tokens[0] == tokens[2] == max_tokens and 2 <= tokens[1] < max_tokens
    assert [o.request_done for o in outputs].count(True) == 1 and outputs[-1].request_done
    assert info["free_kv_blocks"] == info["total_kv_blocks"]
    assert grpc_info.free_kv_blocks == grpc_info.total_kv_blocks and grpc_info.num_running == 0


def test_a_call_that_ends_early_aborts_its_requests(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> dict[str, Any]:
        outbox = Outbox()
        call = stub.Stream(outbox)
        for rid in ("x", "y"):
            outbox.send(_gen(_request(rid, [5, 6, 7], 500)))
        async for msg in call:
            if msg.outputs:
                break
        call.cancel()  # the caller went away with both requests running
        return await _idle(eng)

    info = serve(engine, scenario)
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["free_kv_blocks"] == info["total_kv_blocks"]


def test_a_stream_to_an_engine_not_running_ends_unavailable() -> None:
    # The servicer before the engine is attached (loading, warm-up): the call ends with UNAVAILABLE, mapped
    # by the interceptor as for Generate, instead of an unmapped UNKNOWN.
    async def main() -> grpc.StatusCode:
        server, _ = new_server(SERVICE_NAME, max_receive_bytes=MAX_MESSAGE_BYTES)
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                outbox = Outbox()  # nothing sent: a write into the ending call could race its status
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in engine_pb2_grpc.EngineStub(channel).Stream(outbox):
                        pass
                return err.value.code()
        finally:
            await server.stop(0)

    assert asyncio.run(main()) is grpc.StatusCode.UNAVAILABLE


def test_a_request_past_the_receive_limit_is_refused_unread_and_the_longest_prompt_is_read(
        engine: AsyncEngine) -> None:
    """The limit serve() sets: max_model_len ids inline (4 bytes each at most) and room for the other fields."""
    max_model_len = engine.core.max_model_len
    limit = engine_max_request_bytes(max_model_len)
    top_id = engine.core.model_config.vocab_size - 1
    # Longer than any prompt that fits, in the widest ids: read, then refused by the engine's own check.
    too_long = _request("long", [top_id] * (max_model_len + 1), 1)
    assert too_long.ByteSize() < limit
    huge = _request("huge", [5], 1, guided=common_pb2.GuidedDecoding(regex="a" * limit))

    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> list[tuple[grpc.StatusCode, str]]:
        out = []
        for req in (too_long, huge):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(req):
                    pass
            out.append((err.value.code(), err.value.details() or ""))
        return out

    (long_code, long_details), (huge_code, huge_details) = serve(engine, scenario)
    assert long_code is grpc.StatusCode.INVALID_ARGUMENT and f"more than max_model_len {max_model_len}" in long_details
    assert huge_code is grpc.StatusCode.RESOURCE_EXHAUSTED and str(limit) in huge_details
