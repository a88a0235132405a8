"""The tokenizer service as a real process, in front of a scripted fake engine (token ids we choose)."""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.procs import free_port, grpc_serving, spawn, stop, tokenizer_process, wait_until

EMOJI_CJK = "Fun 🎉🚀 times: 你好，世界！ and 東京タワー 🌸."


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """Streams a fixed list of token ids, ``group`` per message (one by default, as a stream interval
    would group them), to each of a request's n sequences (``scripts`` overrides it per index); records
    requests, aborts (a request id, or (request id, index) for one sequence) and how ids arrived. A sequence
    aborted alone ends with FINISH_REASON_ABORTED and the others go on, as the engine does."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.scripts: dict[int, list[int]] = {}
        self.group = 1
        self.requests: list[engine_pb2.EngineGenerateRequest] = []
        self.aborted: list[str | tuple[str, int]] = []
        self.sent: list[int] = []
        self.cancelled = threading.Event()
        self.address = ""

    def GetInfo(self, request, context):  # noqa: N802
        return engine_pb2.GetInfoResponse(model_name="fake", max_model_len=4096, vocab_size=49152,
                                          eos_token_ids=[2], bos_token_id=1, block_size=16)

    def RegisterSharedMemory(self, request, context):  # noqa: N802
        return engine_pb2.RegisterSharedMemoryResponse(ok=False, error="fake engine: inline only")

    def Abort(self, request, context):  # noqa: N802
        self.aborted.extend(request.request_ids)
        self.aborted.extend((s.request_id, s.index) if s.HasField("index") else s.request_id
                            for s in request.sequences)
        return engine_pb2.AbortResponse()

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.sent = []
        complete = []
        # On the call's end, whatever ends it: a cancelled call may never resume this generator.
        context.add_callback(lambda: None if complete else self.cancelled.set())
        scripts = {i: self.scripts.get(i, self.script) for i in range(request.n or 1)}
        for i in range(0, max(map(len, scripts.values())), self.group):
            if not context.is_active():
                return
            for index, script in list(scripts.items()):
                aborted = (request.request_id, index) in self.aborted
                toks = [] if aborted else script[i:i + self.group]
                last = aborted or i + self.group >= len(script)
                if last:
                    del scripts[index]
                if index == 0:
                    self.sent.extend(toks)
                yield engine_pb2.EngineGenerateResponse(
                    index=index, token_ids=toks, prompt_tokens=len(request.prompt_token_ids.ids),
                    request_done=not scripts,
                    finish_reason=(common_pb2.FINISH_REASON_ABORTED if aborted else common_pb2.FINISH_REASON_LENGTH
                                   if last else common_pb2.FINISH_REASON_UNSPECIFIED))
            time.sleep(0.01)
        complete.append(True)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path())


class CurrentEngine(engine_pb2_grpc.EngineServicer):
    """Hands each call to the running test's own ScriptedEngine: one server and one tokenizer process serve the
    module (a process takes ~1 s to start and stop), and a call still running from an earlier test keeps
    updating its own test's engine, not the next one's."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.engine = ScriptedEngine([])

    def GetInfo(self, request, context):  # noqa: N802
        return self.engine.GetInfo(request, context)

    def RegisterSharedMemory(self, request, context):  # noqa: N802
        return self.engine.RegisterSharedMemory(request, context)

    def Abort(self, request, context):  # noqa: N802
        return self.engine.Abort(request, context)

    def Generate(self, request, context):  # noqa: N802
        return self.engine.Generate(request, context)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Iterator[tuple[CurrentEngine, str]]:
    port = free_port()
    current = CurrentEngine(f"127.0.0.1:{port}")
    server = grpc.server(futures.ThreadPoolExecutor(8))
    engine_pb2_grpc.add_EngineServicer_to_server(current, server)
    server.add_insecure_port(current.address)
    server.start()
    try:
        with tokenizer_process(tmp_path_factory.mktemp("tokenizer"), current.address) as addr:
            yield current, addr
    finally:
        server.stop(0)


@pytest.fixture()
def fake(served: tuple[CurrentEngine, str]) -> tuple[ScriptedEngine, str]:
    """A fresh ScriptedEngine behind the module's engine address and tokenizer service."""
    current, addr = served
    engine = ScriptedEngine([])
    engine.address = current.address
    current.engine = engine
    return engine, addr


class ForgetfulEngine(ScriptedEngine):
    """Maps the tokenizer's shared memory, then (``forget``) refuses the next shared-memory prompt as an engine
    that restarted would: INVALID_ARGUMENT with the typed reason, and details that say nothing about it."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(script)
        self.registrations = 0
        self.forget = False

    def RegisterSharedMemory(self, request, context):  # noqa: N802
        self.registrations += 1
        return engine_pb2.RegisterSharedMemoryResponse(ok=True)

    def Generate(self, request, context):  # noqa: N802
        if self.forget and request.HasField("prompt_shm"):
            self.forget = False
            context.set_trailing_metadata((("sluice-error-reason", "ERROR_REASON_SHM_NOT_REGISTERED"),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        yield from super().Generate(request, context)


def test_a_lost_shared_memory_registration_is_known_by_its_typed_reason_and_registered_again(
        tmp_path: Path) -> None:
    engine = ForgetfulEngine([100, 101])
    server = grpc.server(futures.ThreadPoolExecutor(8))
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        with tokenizer_process(tmp_path, f"127.0.0.1:{port}") as addr:
            assert _stream(addr)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert engine.registrations == 1 and engine.requests[-1].HasField("prompt_shm")
            engine.forget = True
            with pytest.raises(grpc.RpcError) as err:
                _stream(addr)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE  # the client retries
            assert _stream(addr)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert engine.registrations == 2 and engine.requests[-1].HasField("prompt_shm")
    finally:
        server.stop(0)


def _stream(addr: str, **kw: object) -> list[generation_pb2.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(addr))
    return list(stub.Generate(generation_pb2.GenerateRequest(text="hi", **kw), timeout=30))


def test_emoji_and_cjk_stream_without_replacement_chars(fake: tuple[ScriptedEngine, str],
                                                        tokenizer: Tokenizer) -> None:
    engine, addr = fake
    ids = tokenizer.encode(EMOJI_CJK, add_special_tokens=False)
    partial = [t for t in ids if b"\xef\xbf\xbd" not in tokenizer.token_to_bytes(t)
               and tokenizer.token_to_bytes(t).decode("utf-8", "replace") != tokenizer.token_to_bytes(t).decode(
                   "utf-8", "ignore")]
    assert partial, "the script must contain tokens that are only part of a UTF-8 character"
    engine.script = ids
    msgs = _stream(addr)
    assert all("\ufffd" not in m.text for m in msgs)
    assert "".join(m.text for m in msgs) == EMOJI_CJK
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == len(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_three_tokens_is_never_leaked(fake: tuple[ScriptedEngine, str],
                                                           tokenizer: Tokenizer, include: bool) -> None:
    engine, addr = fake
    text = "The answer is forty-two, obviously. Then more text follows here and goes on."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    # A stop string covering exactly three whole tokens, in the middle of the output.
    start = 4
    stop = "".join(pieces[start:start + 3])
    assert len(stop.strip()) > 3 and text.count(stop) == 1
    engine.script = ids
    msgs = _stream(addr, stopping=generation_pb2.StoppingCriteria(stop=[stop],
                                                                  include_stop_str_in_output=include))
    emitted = "".join(m.text for m in msgs)
    before = text[: text.index(stop)]
    assert emitted == (before + stop if include else before)
    if not include:
        # Not even part of the stop string reached the client: every prefix of the stream is a prefix of `before`.
        so_far = ""
        for m in msgs:
            so_far += m.text
            assert before.startswith(so_far)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert msgs[-1].stop_string == stop
    # Its only sequence ended: the service leaves the engine call, which aborts the engine request.
    assert engine.cancelled.wait(5), "a matched stop string must abort the engine request"
    assert len(engine.sent) < len(ids)


def test_a_stop_string_ends_only_its_own_sequence_of_n(fake: tuple[ScriptedEngine, str],
                                                       tokenizer: Tokenizer) -> None:
    engine, addr = fake
    first = "The answer is forty-two, obviously. Then more text follows here and goes on."
    second = "Something else entirely, with no marker in it at all."
    engine.script = tokenizer.encode(first, add_special_tokens=False)
    engine.scripts = {1: tokenizer.encode(second, add_special_tokens=False)}
    msgs = _stream(addr, n=2, request_id="two", stopping=generation_pb2.StoppingCriteria(stop=["obviously"]))
    text = {i: "".join(m.text for m in msgs if m.index == i) for i in (0, 1)}
    assert text == {0: first[: first.index("obviously")], 1: second}
    finals = [(m.index, m.finish_reason) for m in msgs if m.finish_reason]
    assert finals == [(0, common_pb2.FINISH_REASON_STOP_STRING), (1, common_pb2.FINISH_REASON_LENGTH)]
    # Sequence 0 alone was aborted in the engine; sequence 1 ran on to its end, and so did the call.
    (sent,) = engine.requests   # under Sluice's own key, with the caller's id beside it for logs and spans
    assert sent.client_request_id == "two" and sent.request_id != "two"
    assert engine.aborted == [(sent.request_id, 0)] and not engine.cancelled.is_set()


def test_stream_interval_goes_to_the_engine_and_a_stop_string_inside_a_group_ends_the_tokens_there(
        fake: tuple[ScriptedEngine, str], tokenizer: Tokenizer) -> None:
    engine, addr = fake
    text = "The answer is forty-two, obviously. Then more text follows here and goes on."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    stop = "".join(pieces[5:7])  # completes with token 6, in the middle of the group of tokens 4..7
    assert text.count(stop) == 1
    engine.script, engine.group = ids, 4
    msgs = _stream(addr, stopping=generation_pb2.StoppingCriteria(stop=[stop]),
                   response=generation_pb2.ResponseOptions(stream_interval=4, logprobs=False))
    assert engine.requests[-1].HasField("stream_interval") and engine.requests[-1].stream_interval == 4
    assert "".join(m.text for m in msgs) == text[: text.index(stop)]
    # Token 7 came in the same engine message but after the stop string: not returned, not counted.
    assert [t for m in msgs for t in m.token_ids] == ids[:7]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert msgs[-1].usage.completion_tokens == 7


def test_without_stream_interval_the_engine_uses_its_own(fake: tuple[ScriptedEngine, str],
                                                          tokenizer: Tokenizer) -> None:
    engine, addr = fake
    engine.script = tokenizer.encode("Hello there.", add_special_tokens=False)
    msgs = _stream(addr)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert not engine.requests[-1].HasField("stream_interval")


def test_stream_interval_zero_is_invalid_argument(fake: tuple[ScriptedEngine, str]) -> None:
    engine, addr = fake
    engine.script = [100, 101]
    with pytest.raises(grpc.RpcError) as err:
        _stream(addr, response=generation_pb2.ResponseOptions(stream_interval=0))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval" in err.value.details()
    assert engine.requests == []


class _MuxStream:
    """A GenerateStream driven from this thread: ``send`` actions, ``close`` half-closes, ``items`` reads."""

    def __init__(self, addr: str, timeout: float = 30) -> None:
        self._out: queue.Queue[generation_pb2.GenerateStreamRequest | None] = queue.Queue()
        self.channel = grpc.insecure_channel(addr)
        stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.responses = stub.GenerateStream(iter(self._out.get, None), timeout=timeout)

    def send(self, **kw: object) -> None:
        self._out.put(generation_pb2.GenerateStreamRequest(**kw))

    def close(self) -> None:
        self._out.put(None)

    def items(self) -> Iterator[generation_pb2.GenerateStreamItem]:
        for message in self.responses:
            yield from message.items


def _by_id(items: Iterator[generation_pb2.GenerateStreamItem]) -> dict[int, list[generation_pb2.GenerateStreamItem]]:
    out: dict[int, list[generation_pb2.GenerateStreamItem]] = {}
    for item in items:
        assert not (out.get(item.id) and out[item.id][-1].end), f"item for {item.id} after its end"
        out.setdefault(item.id, []).append(item)
    return out


def test_generate_stream_requests_get_what_their_generate_calls_get(fake: tuple[ScriptedEngine, str],
                                                                    tokenizer: Tokenizer) -> None:
    engine, addr = fake
    text = "The answer is forty-two, obviously. Then more text follows here."
    engine.script = tokenizer.encode(text, add_special_tokens=False)
    stop = generation_pb2.StoppingCriteria(stop=["obviously"])
    expected = {1: _stream(addr), 2: _stream(addr, stopping=stop)}
    mux = _MuxStream(addr)
    mux.send(id=1, generate=generation_pb2.GenerateRequest(text="hi", request_id="first"))
    mux.send(id=2, generate=generation_pb2.GenerateRequest(text="hi", stopping=stop))
    mux.close()  # half-closed: both still run to their end, then the stream ends OK
    got = _by_id(mux.items())
    assert sorted(got) == [1, 2]
    for id_, msgs in expected.items():
        items = got[id_]
        assert items[-1].end and items[-1].status_code == grpc.StatusCode.OK.value[0]
        responses = [i.response for i in items if i.HasField("response")]
        assert "".join(r.text for r in responses) == "".join(m.text for m in msgs)
        assert [t for r in responses for t in r.token_ids] == [t for m in msgs for t in m.token_ids]
        assert responses[-1].finish_reason == msgs[-1].finish_reason
        assert responses[-1].usage == msgs[-1].usage
    assert "".join(i.response.text for i in got[2]) == text[: text.index("obviously")]
    assert {i.response.request_id for i in got[1] if i.HasField("response")} == {"first"}


def test_generate_stream_errors_end_only_their_request(fake: tuple[ScriptedEngine, str],
                                                       tokenizer: Tokenizer) -> None:
    engine, addr = fake
    engine.script = tokenizer.encode("Hello there.", add_special_tokens=False)
    mux = _MuxStream(addr)
    mux.send(id=7, generate=generation_pb2.GenerateRequest(
        text="hi", response=generation_pb2.ResponseOptions(stream_interval=0)))
    mux.send(id=8, generate=generation_pb2.GenerateRequest(text="hi", model="not-this-one"))
    mux.send(id=9, generate=generation_pb2.GenerateRequest(text="hi"))
    mux.close()
    got = _by_id(mux.items())
    assert len(got[7]) == 1 and got[7][0].end and not got[7][0].HasField("response")
    assert got[7][0].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "stream_interval" in got[7][0].status_message
    assert got[8][-1].status_code == grpc.StatusCode.NOT_FOUND.value[0]  # OpenAI's 404 model_not_found
    assert got[8][-1].status_message == ("model: 'not-this-one' is not served here (serving 'SmolLM2-135M-Instruct'; "
                                         "LoRA adapters need --enable-lora)")
    assert got[9][-1].end and got[9][-1].status_code == 0
    assert "".join(i.response.text for i in got[9]) == "Hello there."
    assert len(engine.requests) == 1  # the two bad ones never reached the engine


def test_generate_stream_cancel_and_deadline_end_their_requests_and_reach_the_engine(
        fake: tuple[ScriptedEngine, str]) -> None:
    engine, addr = fake
    engine.script = [100 + i % 50 for i in range(500)]  # 10 ms a token: 5 s
    mux = _MuxStream(addr)
    mux.send(id=1, generate=generation_pb2.GenerateRequest(text="hi"))
    items = mux.items()
    first = next(items)
    assert first.id == 1 and first.HasField("response") and not first.end
    mux.send(id=1, cancel=True)
    mux.send(id=5, cancel=True)  # not open: ignored
    rest = [i for i in _take_until_end(items, 1)]
    assert rest[-1].status_code == grpc.StatusCode.CANCELLED.value[0]
    assert engine.cancelled.wait(5), "the engine call must be cancelled"
    engine.cancelled.clear()
    started = time.monotonic()
    mux.send(id=2, generate=generation_pb2.GenerateRequest(text="hi"), timeout_ms=1000)
    rest = [i for i in _take_until_end(items, 2)]
    assert rest[0].HasField("response")  # the engine was generating when the deadline came
    assert rest[-1].status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert 0.9 < time.monotonic() - started < 5
    assert engine.cancelled.wait(5)
    engine.script = [100, 101]
    mux.send(id=1, generate=generation_pb2.GenerateRequest(text="hi"))  # an ended id may be used again
    mux.close()
    again = [i for i in items]
    assert again[-1].id == 1 and again[-1].end and again[-1].status_code == 0


def _take_until_end(items: Iterator[generation_pb2.GenerateStreamItem], id_: int
                    ) -> Iterator[generation_pb2.GenerateStreamItem]:
    for item in items:
        if item.id == id_:
            yield item
            if item.end:
                return


def test_generate_stream_with_an_open_id_twice_is_invalid_argument(fake: tuple[ScriptedEngine, str]) -> None:
    engine, addr = fake
    engine.script = [100 + i % 50 for i in range(500)]
    mux = _MuxStream(addr)
    mux.send(id=3, generate=generation_pb2.GenerateRequest(text="hi"))
    items = mux.items()
    assert next(items).id == 3  # generating
    mux.send(id=3, generate=generation_pb2.GenerateRequest(text="hi"))
    with pytest.raises(grpc.RpcError) as err:
        list(items)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "still open" in err.value.details()
    assert engine.cancelled.wait(5), "the stream's open request is aborted with it"
    mux.close()
    mux.channel.close()


def test_generate_stream_on_sigterm_finishes_open_requests_refuses_new_ones_and_ends(
        fake: tuple[ScriptedEngine, str], tmp_path: Path) -> None:
    engine, engine_addr = fake[0], fake[0].address
    engine.script = [100 + i % 50 for i in range(100)]  # 10 ms a token: about 1 s
    port = free_port()
    proc = spawn(["-m", "services.tokenizer", "--engine", engine_addr, "--port", str(port),
                  "--shutdown-timeout", "30"], tmp_path / "tokenizer-drain.log")
    try:
        addr = f"127.0.0.1:{port}"
        wait_until(lambda: grpc_serving(addr, "sluice.v1.Generation"), 120, proc, "tokenizer ready")
        mux = _MuxStream(addr)
        mux.send(id=1, generate=generation_pb2.GenerateRequest(text="hi"))
        items = mux.items()
        assert next(items).id == 1
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not grpc_serving(addr, "sluice.v1.Generation"), 10, None, "draining")
        mux.send(id=2, generate=generation_pb2.GenerateRequest(text="hi"))
        got = _by_id(items)  # ends by itself: the client never half-closes
        assert got[2] == [generation_pb2.GenerateStreamItem(
            id=2, end=True, status_code=grpc.StatusCode.UNAVAILABLE.value[0],
            status_message="the tokenizer service is shutting down")]
        assert got[1][-1].end and got[1][-1].status_code == 0
        assert sum(len(i.response.token_ids) for i in got[1]) == 99  # the first one was read before
        assert proc.wait(timeout=20) == 0
        mux.close()
        mux.channel.close()
    finally:
        stop(proc)
