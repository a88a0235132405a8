"""The tokenizer service as a real process, in front of a scripted fake engine (token ids we choose)."""

from __future__ import annotations

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
from tests.procs import free_port, tokenizer_process

EMOJI_CJK = "Fun 🎉🚀 times: 你好，世界！ and 東京タワー 🌸."


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """Streams a fixed list of token ids, ``group`` per message (one by default, as a stream interval
    would group them); records requests, aborts and how ids arrived."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.group = 1
        self.requests: list[engine_pb2.EngineGenerateRequest] = []
        self.aborted: list[str] = []
        self.sent: list[int] = []
        self.cancelled = threading.Event()

    def GetInfo(self, request, context):  # noqa: N802
        return engine_pb2.GetInfoResponse(model_name="fake", max_model_len=4096, vocab_size=49152,
                                          eos_token_ids=[2], bos_token_id=1, block_size=16)

    def RegisterSharedMemory(self, request, context):  # noqa: N802
        return engine_pb2.RegisterSharedMemoryResponse(ok=False, error="fake engine: inline only")

    def Abort(self, request, context):  # noqa: N802
        self.aborted.extend(request.request_ids)
        return engine_pb2.AbortResponse()

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        self.sent = []
        for i in range(0, len(self.script), self.group):
            if not context.is_active():
                self.cancelled.set()
                return
            toks = self.script[i:i + self.group]
            last = i + self.group >= len(self.script)
            self.sent.extend(toks)
            yield engine_pb2.EngineGenerateResponse(
                token_ids=toks, prompt_tokens=len(request.prompt_token_ids.ids),
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED)
            time.sleep(0.01)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_path())


@pytest.fixture()
def fake(tmp_path: Path, tokenizer: Tokenizer) -> Iterator[tuple[ScriptedEngine, str]]:
    engine = ScriptedEngine([])
    server = grpc.server(futures.ThreadPoolExecutor(8))
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        with tokenizer_process(tmp_path, f"127.0.0.1:{port}") as addr:
            yield engine, addr
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
    deadline = time.monotonic() + 5
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.aborted, "a matched stop string must abort the engine request"
    assert len(engine.sent) < len(ids)


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
