"""The engine servicer's LoRA side on a real grpc.aio server on 127.0.0.1: adapters by name (NOT_FOUND for any
other), GetInfo's list, runtime Load / Unload with their status codes and messages, and an unload that lets the
running requests finish before the weights go. The executor is a fake that records what the core loads and frees
(the adapters' arithmetic is tested with the worker)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.errors import InvalidRequestError
from common.grpc_server import MAX_MESSAGE_BYTES, new_server
from engine.config import EngineConfig, LoRAConfig, LoRAModule
from engine.core import engine_core
from engine.core.engine_core import EngineCore
from engine.core.lora_request import LoRARequest
from engine.core.scheduler_output import SchedulerOutput
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.grpc_servicer import SERVICE_NAME, EngineServicer
from engine.entrypoints.lora_registry import LoRARegistry
from engine.worker.model_runner import RunnerOutput
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.engine.core.test_lora_scheduling import FakeExecutor
from tests.engine.entrypoints.test_grpc_servicer import Outbox, _gen, _request
from tests.procs import free_port

pytestmark = pytest.mark.slow

SERVED = "tiny"
ON = "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)"


class FolderExecutor(FakeExecutor):
    """Refuses a folder without adapter_config.json, as the worker does; a step takes a few milliseconds."""

    def add_lora(self, lora: LoRARequest) -> None:
        if not (Path(lora.lora_path) / "adapter_config.json").is_file():
            raise InvalidRequestError("lora_path", f"{lora.lora_path}: no adapter_config.json")
        super().add_lora(lora)

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        time.sleep(0.005)
        return super().execute_model(sched)


def adapter_dir(root: Path, name: str) -> str:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return str(root / name)


Served = tuple[AsyncEngine, LoRARegistry, FolderExecutor]


def start(lora_config: LoRAConfig | None) -> Served:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_core, "make_executor", FolderExecutor)
        core = EngineCore(EngineConfig(served_model_name=SERVED, block_size=4, lora_config=lora_config))
    registry = LoRARegistry(core.config)
    registry.load_startup_modules(core)
    assert isinstance(core.executor, FolderExecutor)
    return AsyncEngine(core), registry, core.executor


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for name in ("sql", "chat", "late"):
        adapter_dir(root, name)
    return root


@pytest.fixture
def served(adapters: Path) -> Iterator[Served]:
    modules = (LoRAModule("sql", str(adapters / "sql")), LoRAModule("chat", str(adapters / "chat"), "tiny-base"))
    engine, registry, executor = start(LoRAConfig(max_loras=2, lora_modules=modules,
                                                  allow_runtime_lora_updating=True))
    yield engine, registry, executor
    engine.shutdown()


def serve(served: Served, scenario: Callable[[engine_pb2_grpc.EngineStub], Awaitable[Any]]) -> Any:
    engine, registry, _ = served

    async def main() -> Any:
        server, _ = new_server(SERVICE_NAME, max_receive_bytes=MAX_MESSAGE_BYTES)
        engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine, registry), server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await asyncio.wait_for(scenario(engine_pb2_grpc.EngineStub(channel)), 60)
        finally:
            await server.stop(0)

    return asyncio.run(main())


async def status(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def generate(stub: engine_pb2_grpc.EngineStub, rid: str, adapter: str, max_tokens: int = 3) -> list[int]:
    return [t async for m in stub.Generate(_request(rid, [5, 6, 7, 8, 9], max_tokens, lora_adapter=adapter))
            for t in m.token_ids]


def adapters_of(info: engine_pb2.GetInfoResponse) -> list[tuple[str, str]]:
    return [(a.name, a.base_model_name) for a in info.lora_adapters]


def test_requests_pick_an_adapter_by_name_and_get_info_lists_them(served: Served) -> None:
    registry, executor = served[1], served[2]

    async def scenario(stub: engine_pb2_grpc.EngineStub) -> tuple[Any, ...]:
        info = await stub.GetInfo(engine_pb2.GetInfoRequest())
        tokens = {name: await generate(stub, f"r-{name or 'base'}", name) for name in ("sql", "chat", "", SERVED)}
        return info, tokens, await status(generate(stub, "unknown", "nope"))

    info, tokens, unknown = serve(served, scenario)
    assert info.lora_enabled and adapters_of(info) == [("sql", SERVED), ("chat", "tiny-base")]
    assert tokens == {name: [7, 7, 7] for name in ("sql", "chat", "", SERVED)}
    sql, chat = (registry.resolve(name) for name in ("sql", "chat"))
    assert sql is not None and chat is not None
    # The start-up modules were loaded before serving; each request ran through its own adapter, by id.
    assert executor.added == [sql.lora_int_id, chat.lora_int_id] == [1, 2]
    assert [step[0] for step in executor.steps if step] == [1, 1, 1, 2, 2, 2, None, None, None, None, None, None]
    assert unknown == (grpc.StatusCode.NOT_FOUND, "The model `nope` does not exist.")


def test_an_unknown_adapter_in_a_stream_is_refused_alone_with_not_found(served: Served) -> None:
    async def scenario(stub: engine_pb2_grpc.EngineStub) -> list[engine_pb2.EngineStreamResponse]:
        outbox = Outbox()
        outbox.send(_gen(_request("bad", [5, 6, 7], 2, lora_adapter="nope")))
        outbox.send(_gen(_request("good", [5, 6, 7], 2, lora_adapter="sql")))
        outbox.close()
        return [m async for m in stub.Stream(outbox)]

    messages = serve(served, scenario)
    errors = [e for m in messages for e in m.errors]
    assert [(e.request_id, e.code, e.message) for e in errors] == [
        ("bad", grpc.StatusCode.NOT_FOUND.value[0], "The model `nope` does not exist.")]
    assert [t for m in messages for o in m.outputs if o.request_id == "good" for t in o.token_ids] == [7, 7]


def test_load_and_unload_at_runtime(served: Served, adapters: Path, tmp_path: Path) -> None:
    registry, executor = served[1], served[2]

    async def scenario(stub: engine_pb2_grpc.EngineStub) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        late = common_pb2.LoadLoRAAdapterRequest(lora_name="late", lora_path=str(adapters / "late"))
        seen["before"] = await status(generate(stub, "early", "late"))
        seen["loaded"] = await stub.LoadLoRAAdapter(late)
        seen["tokens"] = await generate(stub, "r1", "late")
        seen["again"] = await status(stub.LoadLoRAAdapter(late))
        seen["bad"] = await status(stub.LoadLoRAAdapter(
            common_pb2.LoadLoRAAdapterRequest(lora_name="bad", lora_path=str(tmp_path))))
        seen["no name"] = await status(stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_path="/x")))
        seen["served name"] = await status(stub.LoadLoRAAdapter(
            common_pb2.LoadLoRAAdapterRequest(lora_name=SERVED, lora_path=str(adapters / "late"))))
        # A failed load leaves its name free.
        adapter_dir(tmp_path, "fixed")
        seen["bad fixed"] = await stub.LoadLoRAAdapter(
            common_pb2.LoadLoRAAdapterRequest(lora_name="bad", lora_path=str(tmp_path / "fixed"),
                                              base_model_name="other-base"))
        seen["info"] = await stub.GetInfo(engine_pb2.GetInfoRequest())
        seen["unload"] = await stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="late"))
        seen["after"] = await status(generate(stub, "late-after", "late"))
        seen["unload again"] = await status(stub.UnloadLoRAAdapter(
            common_pb2.UnloadLoRAAdapterRequest(lora_name="late")))
        seen["reloaded"] = await stub.LoadLoRAAdapter(late)
        seen["info2"] = await stub.GetInfo(engine_pb2.GetInfoRequest())
        return seen

    seen = serve(served, scenario)
    assert seen["before"] == (grpc.StatusCode.NOT_FOUND, "The model `late` does not exist.")
    assert seen["loaded"].adapter == common_pb2.LoRAAdapter(name="late", base_model_name=SERVED)
    assert seen["tokens"] == [7, 7, 7]
    assert seen["again"] == (grpc.StatusCode.ALREADY_EXISTS, "The lora adapter 'late' has already been loaded.")
    assert seen["bad"] == (grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {tmp_path}: no adapter_config.json")
    assert seen["no name"] == (grpc.StatusCode.INVALID_ARGUMENT, "lora_name: is required")
    assert seen["served name"] == (grpc.StatusCode.INVALID_ARGUMENT, "lora_name: 'tiny' is the served model's name")
    assert seen["bad fixed"].adapter == common_pb2.LoRAAdapter(name="bad", base_model_name="other-base")
    assert adapters_of(seen["info"]) == [("sql", SERVED), ("chat", "tiny-base"), ("late", SERVED),
                                         ("bad", "other-base")]
    assert seen["after"] == (grpc.StatusCode.NOT_FOUND, "The model `late` does not exist.")
    assert seen["unload again"] == (grpc.StatusCode.NOT_FOUND, "The lora adapter 'late' cannot be found.")
    # Loaded again: a fresh id, so it never hits the blocks of the weights the name had before.
    assert adapters_of(seen["info2"]) == [("sql", SERVED), ("chat", "tiny-base"), ("bad", "other-base"),
                                          ("late", SERVED)]
    late = registry.resolve("late")
    assert late is not None and late.lora_int_id == 6   # 4 went to the load that failed
    assert executor.added == [1, 2, 3, 5, 6] and executor.removed == [3]


def test_unload_lets_running_requests_finish_then_frees_the_weights(served: Served) -> None:
    engine, executor = served[0], served[2]

    async def scenario(stub: engine_pb2_grpc.EngineStub) -> tuple[Any, ...]:
        call = stub.Generate(_request("long", [5, 6, 7, 8], 200, lora_adapter="sql"))
        stream = call.__aiter__()
        first = await stream.__anext__()
        await stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="sql"))
        during = (list(executor.removed), await engine.call(lambda core: core.list_loras()),
                  await status(generate(stub, "new", "sql")))
        rest = [m async for m in stream]
        for _ in range(100):   # the core frees it right after the step that ended the request
            if executor.removed:
                break
            await asyncio.sleep(0.01)
        return first, during, rest, await engine.call(lambda core: core.list_loras())

    first, during, rest, after = serve(served, scenario)
    assert during == ([], {1, 2}, (grpc.StatusCode.NOT_FOUND, "The model `sql` does not exist."))
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 200
    assert rest[-1].request_done and rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert executor.removed == [1] and after == {2}


@pytest.mark.parametrize("lora_config, message", [
    (None, f"LoRA is not enabled: start the engine with --enable-lora and {ON} to load adapters at runtime"),
    (LoRAConfig(), f"loading and unloading LoRA adapters at runtime is off: start the engine with {ON}"),
])
def test_runtime_updates_need_their_flag(lora_config: LoRAConfig | None, message: str) -> None:
    served = start(lora_config)

    async def scenario(stub: engine_pb2_grpc.EngineStub) -> tuple[Any, ...]:
        return (await status(stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name="a", lora_path="/a"))),
                await status(stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="a"))),
                await stub.GetInfo(engine_pb2.GetInfoRequest()),
                await status(generate(stub, "r", "a")))

    try:
        load, unload, info, unknown = serve(served, scenario)
    finally:
        served[0].shutdown()
    assert load == unload == (grpc.StatusCode.FAILED_PRECONDITION, message)
    assert info.lora_enabled == (lora_config is not None) and list(info.lora_adapters) == []
    assert unknown == (grpc.StatusCode.NOT_FOUND, "The model `a` does not exist.")


def test_a_bad_startup_adapter_stops_startup_naming_it(adapters: Path, tmp_path: Path) -> None:
    modules = (LoRAModule("sql", str(adapters / "sql")), LoRAModule("broken", str(tmp_path)))
    with pytest.raises(InvalidRequestError) as e:
        start(LoRAConfig(lora_modules=modules))
    assert (e.value.field, e.value.message) == (
        "lora_path", f"--lora-modules broken={tmp_path}: {tmp_path}: no adapter_config.json")
