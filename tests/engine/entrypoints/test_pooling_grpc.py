"""Engine.Pool through a real servicer on a grpc.aio server in this process: the rows equal sentence-transformers'
on the same checkpoint, concurrent calls batch, GetInfo describes the pooling model, and refusals carry the
status codes the contract names."""
from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from common.grpc_server import MAX_MESSAGE_BYTES, new_server
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.grpc_servicer import SERVICE_NAME, EngineServicer, warm_up
from engine.entrypoints.grpc_wire import pooling_info_fields
from proto.sluice.v1 import engine_pb2, engine_pb2_grpc
from tests.engine.models import pooling_factory as factory
from tests.procs import free_port

pytestmark = pytest.mark.slow
st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

TEXTS = ["The cat sat on the mat", "hello world", "what is the capital of france? paris.", "a", "dog"]
Scenario = Callable[[engine_pb2_grpc.EngineStub], Awaitable[Any]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return factory.save_tiny_matryoshka_embedder(tmp_path_factory.mktemp("emb"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    core = EngineCore(EngineConfig(model=str(model_dir), dtype="float32", num_threads=1))
    warm_up(core)
    eng = AsyncEngine(core)
    yield eng
    eng.shutdown()


def serve(engine: AsyncEngine, scenario: Scenario) -> Any:
    async def main() -> Any:
        server, _ = new_server(SERVICE_NAME, max_receive_bytes=MAX_MESSAGE_BYTES)
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await asyncio.wait_for(scenario(engine_pb2_grpc.EngineStub(channel)), 60)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def _pool(rid: str, ids: list[int], **kw: Any) -> engine_pb2.EnginePoolRequest:
    req = engine_pb2.EnginePoolRequest(request_id=rid, **kw)
    req.prompt_token_ids.ids.extend(ids)
    return req


def test_concurrent_pool_calls_equal_sentence_transformers(engine: AsyncEngine, model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = st.SentenceTransformer(str(model_dir), device="cpu")
        ref = model.encode(TEXTS)
        ref16 = model.encode(TEXTS, truncate_dim=16, normalize_embeddings=True)
    steps_before = engine.core.total_steps

    async def scenario(stub: engine_pb2_grpc.EngineStub) -> list[engine_pb2.EnginePoolResponse]:
        calls = [stub.Pool(_pool(f"e{i}", x)) for i, x in enumerate(ids)]
        calls += [stub.Pool(_pool(f"d{i}", x, task="embed", dimensions=16)) for i, x in enumerate(ids)]
        return list(await asyncio.gather(*calls))

    replies = serve(engine, scenario)
    full, short = replies[:len(ids)], replies[len(ids):]
    for reply, r, x in zip(full, ref, ids):
        assert reply.row_size == 32 and reply.prompt_tokens == len(x)
        np.testing.assert_allclose(reply.data, r, atol=1e-4)
    for reply, r in zip(short, ref16):
        assert reply.row_size == 16
        np.testing.assert_allclose(reply.data, r, atol=1e-4)
    assert engine.core.total_steps - steps_before < 2 * len(ids)   # batched, not one step per call


def test_get_info_and_refusals(engine: AsyncEngine) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub) -> dict[str, Any]:
        info = await stub.GetInfo(engine_pb2.GetInfoRequest())
        codes: dict[str, Any] = {}
        for name, req in {"task": _pool("t", [2, 40, 3], task="classify"),
                          "unknown": _pool("u", [2, 40, 3], task="bogus"),
                          "dims": _pool("d", [2, 40, 3], dimensions=12),
                          "empty": _pool("e", [])}.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Pool(req)
            codes[name] = (e.value.code(), e.value.details())
        gen = engine_pb2.EngineGenerateRequest(request_id="g", stopping=engine_pb2.EngineStoppingCriteria(
            max_tokens=2))
        gen.prompt_token_ids.ids.extend([2, 40, 3])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(gen):
                pass
        codes["generate"] = (e.value.code(), e.value.details())
        return {"info": info, "codes": codes}

    got = serve(engine, scenario)
    info = got["info"]
    assert info.runner == "pooling" and list(info.pooling_tasks) == ["embed", "token_embed"]
    assert info.embedding_size == 32 and info.is_matryoshka
    assert list(info.matryoshka_dimensions) == list(factory.MATRYOSHKA_DIMENSIONS)
    codes = got["codes"]
    assert codes["task"][0] == grpc.StatusCode.INVALID_ARGUMENT and "'classify'" in codes["task"][1]
    assert codes["unknown"][0] == grpc.StatusCode.INVALID_ARGUMENT and "'bogus'" in codes["unknown"][1]
    assert codes["dims"][0] == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in codes["dims"][1]
    assert codes["empty"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert codes["generate"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "pooling model" in codes["generate"][1] and "embed" in codes["generate"][1]
    assert not engine.core.has_unfinished_requests()


def test_cancelled_pool_call_leaves_nothing_running(engine: AsyncEngine) -> None:
    """Calls cancelled while the engine thread is busy (their requests queued, or just added): each is aborted or
    never added, nothing stays running or holds blocks, and their ids can be used again."""
    async def scenario(stub: engine_pb2_grpc.EngineStub) -> None:
        busy = asyncio.ensure_future(engine.call(lambda core: time.sleep(0.3)))
        calls = [stub.Pool(_pool(f"c{i}", [2, 40 + i, 41, 3])) for i in range(4)]
        await asyncio.sleep(0.1)
        for call in calls:
            call.cancel()
        for call in calls:
            with pytest.raises(asyncio.CancelledError):
                await call
        await busy
        reply = await stub.Pool(_pool("c0", [2, 40, 3]))
        assert reply.row_size == 32
        # Abort (the RPC) of a request added but not yet run: the call ends ABORTED, once
        busy = asyncio.ensure_future(engine.call(lambda core: time.sleep(0.3)))
        call = stub.Pool(_pool("x", [2, 40, 3]))
        await asyncio.sleep(0.1)
        await stub.Abort(engine_pb2.AbortRequest(request_ids=["x"]))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.ABORTED
        await busy

    serve(engine, scenario)
    for _ in range(100):
        if not engine.core.has_unfinished_requests():
            break
        time.sleep(0.01)
    assert not engine.core.has_unfinished_requests()
    assert engine.core.scheduler.block_manager.num_free_blocks == engine.core.num_blocks


def test_generation_model_refuses_pool(tmp_path: Path) -> None:
    from tests.engine.core.tiny_llama import save_tiny_llama

    save_tiny_llama(tmp_path / "llama")
    eng = AsyncEngine(EngineCore(EngineConfig(model=str(tmp_path / "llama"), dtype="float32", num_threads=1,
                                              kv_cache_memory=4 * 2**20)))
    try:
        async def scenario(stub: engine_pb2_grpc.EngineStub) -> Any:
            info = await stub.GetInfo(engine_pb2.GetInfoRequest())
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Pool(_pool("p", [1, 5, 9]))
            return info, e.value

        info, error = serve(eng, scenario)
    finally:
        eng.shutdown()
    assert info.runner == "generate" and not info.pooling_tasks
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "generation model" in error.details()


def test_classifier_labels_in_get_info(tmp_path: Path) -> None:
    core = EngineCore(EngineConfig(model=str(factory.save_tiny_classifier(tmp_path / "clf")), dtype="float32",
                                   num_threads=1))
    fields = pooling_info_fields(core.runner, core.pooling)
    msg = engine_pb2.GetInfoResponse(**fields)
    assert list(msg.labels) == list(factory.CLASSIFIER_LABELS) and list(msg.pooling_tasks) == ["classify"]
