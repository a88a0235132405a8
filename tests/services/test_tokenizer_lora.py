"""LoRA adapters at the text level: the tokenizer service as a real process in front of a scripted fake engine
that serves adapters (the engine's side, resolving names and loading folders, is the engine's tests' to prove)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest

from engine.config import DEFAULT_SERVED_NAME
from proto.sluice.v1 import common_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.procs import free_port, tokenizer_process
from tests.services.test_tokenizer_service import ScriptedEngine, _by_id, _MuxStream

SERVED = DEFAULT_SERVED_NAME
NOT_FOUND_LORA = f"model: 'ghost' is neither the served model '{SERVED}' nor a loaded LoRA adapter"
NOT_FOUND_OFF = f"model: 'ghost' is not served here (serving '{SERVED}'; LoRA adapters need --enable-lora)"
CHAT = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role="user", content="hi")])


class LoRAEngine(ScriptedEngine):
    """The scripted engine with LoRA on: it lists ``adapters`` (name → base model) in GetInfo, refuses an
    unknown ``lora_adapter`` as the engine does (NOT_FOUND), and loads / unloads by the proto's status codes
    (``runtime``: --allow-runtime-lora-updating; a path named "bad" is a folder it cannot serve)."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(script)
        self.adapters = {"sql": "base-7b"}
        self.runtime = True
        self.loads: list[common_pb2.LoadLoRAAdapterRequest] = []
        self.unloads: list[str] = []
        self.lock = threading.Lock()

    def GetInfo(self, request, context):  # noqa: N802
        info = super().GetInfo(request, context)
        info.lora_enabled = True
        with self.lock:
            info.lora_adapters.extend(common_pb2.LoRAAdapter(name=n, base_model_name=b)
                                      for n, b in self.adapters.items())
        return info

    def Generate(self, request, context):  # noqa: N802
        if request.lora_adapter and request.lora_adapter not in self.adapters:
            self.requests.append(request)
            context.abort(grpc.StatusCode.NOT_FOUND, f"lora_adapter: no adapter named {request.lora_adapter!r}")
        yield from super().Generate(request, context)

    def LoadLoRAAdapter(self, request, context):  # noqa: N802
        self.loads.append(request)
        if not self.runtime:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA updating is off")
        if request.lora_name in self.adapters:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"lora_name: {request.lora_name!r} is loaded")
        if request.lora_path == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad/adapter_config.json: r: 64 > --max-lora-rank 16")
        base = request.base_model_name or "fake"
        with self.lock:
            self.adapters[request.lora_name] = base
        return common_pb2.LoadLoRAAdapterResponse(
            adapter=common_pb2.LoRAAdapter(name=request.lora_name, base_model_name=base))

    def UnloadLoRAAdapter(self, request, context):  # noqa: N802
        self.unloads.append(request.lora_name)
        if not self.runtime:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA updating is off")
        with self.lock:
            if self.adapters.pop(request.lora_name, None) is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter named {request.lora_name!r}")
        return common_pb2.UnloadLoRAAdapterResponse()


@dataclass
class Stack:
    engine: ScriptedEngine
    addr: str

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(self.addr))

    def generate(self, **kw: object) -> list[generation_pb2.GenerateResponse]:
        return list(self.stub.Generate(generation_pb2.GenerateRequest(text="hi", **kw), timeout=30))


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Stack]]:
    """A tokenizer service in front of a LoRA engine ("lora") and one in front of an engine without ("off")."""
    tmp = tmp_path_factory.mktemp("lora")
    engines = {"lora": LoRAEngine([100, 101]), "off": ScriptedEngine([100, 101])}
    servers = []
    addrs = {}
    for key, engine in engines.items():
        server = grpc.server(futures.ThreadPoolExecutor(8))
        engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        addrs[key] = f"127.0.0.1:{port}"
    try:
        with tokenizer_process(tmp, addrs["lora"]) as lora, tokenizer_process(tmp, addrs["off"]) as off:
            yield {"lora": Stack(engines["lora"], lora), "off": Stack(engines["off"], off)}
    finally:
        for server in servers:
            server.stop(0)


@pytest.fixture()
def lora(stacks: dict[str, Stack]) -> Iterator[Stack]:
    stack = stacks["lora"]
    engine = stack.engine
    assert isinstance(engine, LoRAEngine)
    yield stack
    with engine.lock:
        engine.adapters, engine.runtime = {"sql": "base-7b"}, True
    engine.requests.clear()
    engine.loads.clear()
    engine.unloads.clear()


def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status ``call`` fails with."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_an_adapter_name_goes_to_the_engine_as_lora_adapter_and_the_base_names_do_not(lora: Stack) -> None:
    msgs = lora.generate(model="sql")
    assert [t for m in msgs for t in m.token_ids] == [100, 101]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert lora.generate(model=SERVED)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert lora.generate()[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [r.lora_adapter for r in lora.engine.requests] == ["sql", "", ""]


def test_generate_stream_requests_carry_their_adapter(lora: Stack) -> None:
    mux = _MuxStream(lora.addr)
    mux.send(id=1, generate=generation_pb2.GenerateRequest(text="hi", model="sql", request_id="a"))
    mux.send(id=2, generate=generation_pb2.GenerateRequest(text="hi", model="ghost", request_id="b"))
    mux.close()
    got = _by_id(mux.items())
    assert got[1][-1].end and got[1][-1].status_code == grpc.StatusCode.OK.value[0]
    assert got[2][-1].status_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert got[2][-1].status_message == "lora_adapter: no adapter named 'ghost'"
    assert sorted(r.lora_adapter for r in lora.engine.requests) == ["ghost", "sql"]
    assert len({r.request_id for r in lora.engine.requests} - {"a", "b"}) == 2  # Sluice's own keys, one each


def test_an_unknown_name_is_the_engines_not_found_with_its_message(lora: Stack) -> None:
    # The engine resolves a generation's adapter (it knows of an unload first): the name reaches it.
    code, details = _code(lambda: lora.generate(model="ghost"))
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "lora_adapter: no adapter named 'ghost'")
    assert [r.lora_adapter for r in lora.engine.requests] == ["ghost"]


def test_with_lora_off_another_name_is_not_found_and_never_reaches_the_engine(stacks: dict[str, Stack]) -> None:
    off = stacks["off"]
    before = len(off.engine.requests)
    assert _code(lambda: off.generate(model="ghost")) == (grpc.StatusCode.NOT_FOUND, NOT_FOUND_OFF)
    assert _code(lambda: off.stub.Tokenize(generation_pb2.TokenizeRequest(text="hi", model="ghost"))) == (
        grpc.StatusCode.NOT_FOUND, NOT_FOUND_OFF)
    assert len(off.engine.requests) == before
    info = off.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert not info.lora_enabled and list(info.lora_adapters) == []


def test_the_text_rpcs_accept_an_adapters_name_and_refuse_an_unknown_one(lora: Stack) -> None:
    stub = lora.stub
    ids = stub.Tokenize(generation_pb2.TokenizeRequest(text="hi there", model="sql")).token_ids
    assert list(ids) == list(stub.Tokenize(generation_pb2.TokenizeRequest(text="hi there")).token_ids)
    assert stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=ids, model="sql")).text == "hi there"
    assert stub.ApplyChatTemplate(generation_pb2.ApplyChatTemplateRequest(chat=CHAT, model="sql")).text == \
        stub.ApplyChatTemplate(generation_pb2.ApplyChatTemplateRequest(chat=CHAT)).text
    assert stub.GetModelInfo(generation_pb2.GetModelInfoRequest(model="sql")).model_name == SERVED
    for call in (lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text="hi", model="ghost")),
                 lambda: stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[1], model="ghost")),
                 lambda: stub.ApplyChatTemplate(generation_pb2.ApplyChatTemplateRequest(chat=CHAT, model="ghost")),
                 lambda: stub.GetModelInfo(generation_pb2.GetModelInfoRequest(model="ghost"))):
        assert _code(call) == (grpc.StatusCode.NOT_FOUND, NOT_FOUND_LORA)
    assert lora.engine.requests == []


def test_an_adapter_loaded_behind_the_services_back_is_found_on_a_miss(lora: Stack) -> None:
    engine = lora.engine
    assert isinstance(engine, LoRAEngine)
    engine.adapters["late"] = "fake"  # loaded through another tokenizer replica: the copy here is stale
    assert lora.stub.Tokenize(generation_pb2.TokenizeRequest(text="hi", model="late")).count > 0


def test_get_model_info_lists_the_engines_adapters(lora: Stack) -> None:
    info = lora.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert info.lora_enabled and info.model_name == SERVED
    assert [(a.name, a.base_model_name) for a in info.lora_adapters] == [("sql", "base-7b")]


def test_load_and_unload_go_to_the_engine_and_change_what_is_served(lora: Stack) -> None:
    engine = lora.engine
    assert isinstance(engine, LoRAEngine)
    stub = lora.stub
    resp = stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name="chat", lora_path="/adapters/chat",
                                                                  base_model_name="base-7b"))
    assert (resp.adapter.name, resp.adapter.base_model_name) == ("chat", "base-7b")
    assert [(r.lora_name, r.lora_path, r.base_model_name) for r in engine.loads] == [
        ("chat", "/adapters/chat", "base-7b")]
    # Known at once, with no wait for the periodic refresh.
    assert stub.Tokenize(generation_pb2.TokenizeRequest(text="hi", model="chat")).count > 0
    assert [a.name for a in stub.GetModelInfo(generation_pb2.GetModelInfoRequest()).lora_adapters] == ["sql", "chat"]
    stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="chat"))
    assert engine.unloads == ["chat"]
    code, details = _code(lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text="hi", model="chat")))
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, NOT_FOUND_LORA.replace("'ghost'", "'chat'"))


@pytest.mark.parametrize(("runtime", "name", "path", "code", "details"), [
    (True, "sql", "/a", grpc.StatusCode.ALREADY_EXISTS, "lora_name: 'sql' is loaded"),
    (True, "new", "bad", grpc.StatusCode.INVALID_ARGUMENT, "bad/adapter_config.json: r: 64 > --max-lora-rank 16"),
    (False, "new", "/a", grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA updating is off"),
])
def test_load_refusals_come_back_with_the_engines_status(lora: Stack, runtime: bool, name: str, path: str,
                                                         code: grpc.StatusCode, details: str) -> None:
    engine = lora.engine
    assert isinstance(engine, LoRAEngine)
    engine.runtime = runtime
    got = _code(lambda: lora.stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)))
    assert got == (code, details)


@pytest.mark.parametrize(("runtime", "code", "details"), [
    (True, grpc.StatusCode.NOT_FOUND, "lora_name: no adapter named 'nope'"),
    (False, grpc.StatusCode.FAILED_PRECONDITION, "runtime LoRA updating is off"),
])
def test_unload_refusals_come_back_with_the_engines_status(lora: Stack, runtime: bool, code: grpc.StatusCode,
                                                           details: str) -> None:
    engine = lora.engine
    assert isinstance(engine, LoRAEngine)
    engine.runtime = runtime
    got = _code(lambda: lora.stub.UnloadLoRAAdapter(common_pb2.UnloadLoRAAdapterRequest(lora_name="nope")))
    assert got == (code, details)


def test_the_served_models_name_cannot_be_an_adapters(lora: Stack) -> None:
    engine = lora.engine
    assert isinstance(engine, LoRAEngine)
    got = _code(lambda: lora.stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name=SERVED,
                                                                                    lora_path="/a")))
    assert got == (grpc.StatusCode.INVALID_ARGUMENT, f"lora_name: {SERVED!r} is the served model's name")
    assert engine.loads == []

