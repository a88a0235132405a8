"""common/auth.py: where keys come from, how they compare, and the interceptor on a real grpc.aio server
(a stand-in Generation servicer in process: the interceptor sees only methods and metadata)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.auth import (
    INVALID_KEY,
    MISSING_KEY,
    ApiKeyInterceptor,
    add_api_key_args,
    api_keys,
    bearer_metadata,
    key_matches,
)
from common.grpc_server import MAX_MESSAGE_BYTES, bind, new_server
from proto.sluice.v1 import generation_pb2, generation_pb2_grpc

SERVICE = "sluice.v1.Generation"
_T = TypeVar("_T")


def keys_of(argv: list[str], environ: dict[str, str] | None = None) -> tuple[str, ...]:
    parser = argparse.ArgumentParser()
    add_api_key_args(parser)
    return api_keys(parser.parse_args(argv), environ or {})


def test_flags_and_file_together_else_the_environment(tmp_path: Path) -> None:
    file = tmp_path / "keys"
    file.write_text("  file-1  \n\nfile-2\nflag\n")
    env = {"SLUICE_API_KEY": "env", "VLLM_API_KEY": "vllm"}
    assert keys_of(["--api-key", "flag", "--api-key-file", str(file)], env) == ("flag", "file-1", "file-2")
    assert keys_of(["--api-key-file", str(file)], env) == ("file-1", "file-2", "flag")
    assert keys_of([], env) == ("env",)
    assert keys_of([], {"VLLM_API_KEY": "vllm"}) == ("vllm",)
    assert keys_of([]) == ()


def test_bad_key_sources_are_refused_naming_them(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=f"--api-key-file {empty}: the file has no keys"):
        keys_of(["--api-key-file", str(empty)])
    with pytest.raises(ValueError, match=f"--api-key-file {tmp_path / 'missing'}: No such file"):
        keys_of(["--api-key-file", str(tmp_path / "missing")])
    for bad in ("", "two words", "ключ"):  # none can travel as `authorization: Bearer <key>` metadata
        with pytest.raises(ValueError, match="printable ASCII without spaces"):
            keys_of(["--api-key", bad])


def test_key_matching() -> None:
    keys = (b"k1", b"k2")
    assert key_matches(b"k1", keys) and key_matches(b"k2", keys)
    assert not key_matches(b"k", keys) and not key_matches(b"k1 ", keys) and not key_matches(b"", keys)


class Calls(generation_pb2_grpc.GenerationServicer):
    """Answers a unary, a response-streaming and a bidirectional method, and counts what reached it."""

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def GetModelInfo(self, request: Any, context: Any) -> generation_pb2.GetModelInfoResponse:  # noqa: N802
        self.reached.append("GetModelInfo")
        return generation_pb2.GetModelInfoResponse(model_name="m")

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[generation_pb2.GenerateResponse]:  # noqa: N802
        self.reached.append("Generate")
        yield generation_pb2.GenerateResponse(text="hi")

    async def GenerateStream(self, requests: Any, context: Any  # noqa: N802
                             ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        self.reached.append("GenerateStream")
        async for r in requests:
            yield generation_pb2.GenerateStreamResponse(
                items=[generation_pb2.GenerateStreamItem(id=r.id, end=True)])


def served(body: Callable[[grpc.aio.Channel, Calls], Awaitable[_T]]) -> _T:
    async def main() -> _T:
        server, health = new_server(SERVICE, max_receive_bytes=MAX_MESSAGE_BYTES,
                                    interceptors=[ApiKeyInterceptor(["key-1", "key-2"])])
        calls = Calls()
        generation_pb2_grpc.add_GenerationServicer_to_server(calls, server)
        await health.set_serving(True)
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(channel, calls)
        finally:
            await server.stop(None)
    return asyncio.run(main())


async def outcome(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def _drain(call: Any) -> list[Any]:
    return [m async for m in call]


async def _never_ending() -> AsyncIterator[generation_pb2.GenerateStreamRequest]:
    yield generation_pb2.GenerateStreamRequest(id=1, generate=generation_pb2.GenerateRequest(text="hi"))
    await asyncio.Event().wait()  # a refused stream must end without waiting for the rest


@pytest.mark.parametrize("metadata, expected", [
    ((), (grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)),
    ((("authorization", "Bearer nope"),), (grpc.StatusCode.UNAUTHENTICATED, INVALID_KEY)),
    ((("authorization", "Basic key-1"),), (grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)),
    ((("authorization", "Bearer key-1 "),), (grpc.StatusCode.OK, "")),
    ((("authorization", "bearer key-2"),), (grpc.StatusCode.OK, "")),
])
def test_every_kind_of_call_is_checked_once_before_its_request_is_read(
        metadata: tuple[tuple[str, str], ...], expected: tuple[grpc.StatusCode, str]) -> None:
    async def body(channel: grpc.aio.Channel, calls: Calls) -> list[tuple[grpc.StatusCode, str]]:
        stub = generation_pb2_grpc.GenerationStub(channel)
        results = [await outcome(stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), metadata=metadata)),
                   await outcome(_drain(stub.Generate(generation_pb2.GenerateRequest(text="hi"), metadata=metadata)))]
        stream = stub.GenerateStream(_never_ending(), metadata=metadata)
        if expected[0] is grpc.StatusCode.OK:  # served: one answer, then we hang up
            first = await asyncio.wait_for(stream.read(), 5)
            assert first.items[0].id == 1
            stream.cancel()
            results.append((grpc.StatusCode.OK, ""))
        else:
            results.append(await asyncio.wait_for(outcome(_drain(stream)), 5))
        assert calls.reached == (["GetModelInfo", "Generate", "GenerateStream"]
                                 if expected[0] is grpc.StatusCode.OK else [])
        return results

    assert served(body) == [expected] * 3


def test_health_and_reflection_need_no_key() -> None:
    async def body(channel: grpc.aio.Channel, calls: Calls) -> tuple[int, list[str]]:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = [a async for a in reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
        return health.status, [s.name for s in answers[0].list_services_response.service]

    status, services = served(body)
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICE in services


def test_bearer_metadata_is_what_the_interceptor_reads() -> None:
    async def body(channel: grpc.aio.Channel, calls: Calls) -> tuple[grpc.StatusCode, str]:
        return await outcome(generation_pb2_grpc.GenerationStub(channel).GetModelInfo(
            generation_pb2.GetModelInfoRequest(), metadata=(bearer_metadata("key-2"),)))

    assert served(body) == (grpc.StatusCode.OK, "")
