"""Invalid UTF-8 in a public gRPC string field (issue 44, part 5; the 2026-11-28 probe): every ``string`` field
reachable from ``GenerateRequest``, ``TokenizeRequest`` and ``GenerateStreamRequest`` (nested, repeated and map
fields included; a streamed call's first message) is sent with bytes that are not UTF-8, to the tokenizer
service's public server; each call is INVALID_ARGUMENT naming that field, with no ERROR logged (before the fix:
UNKNOWN from grpc's deserializer, and a traceback). The bytes are built with protobuf's own serializer and checked
to be refused by its own parser; the field paths come from the descriptors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from engine.config import default_model_path
from engine.text import Tokenizer
from proto.sluice.v1 import engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.tokenizer.server import public_server
from services.tokenizer.service import GenerationServicer
from tests.services.test_bounded_input import MAX_MODEL_LEN, InfoEngine

MARK = "\u2603MARK"  # replaced in the serialized bytes by as many bytes that are not UTF-8
BAD = b"\xff" * (len(MARK.encode()) - 1) + b"\xc3"  # 0xff never occurs in UTF-8; a lone lead byte at the end
Path = tuple[FieldDescriptor, ...]


def string_paths(desc: Descriptor, seen: frozenset[str] = frozenset()) -> Iterator[Path]:
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            yield (f,)
        elif f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.full_name not in seen:
            for rest in string_paths(f.message_type, seen | {desc.full_name}):
                yield (f, *rest)


def set_string(msg: Any, path: Path) -> None:
    f, rest = path[0], path[1:]
    if f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
        entries = getattr(msg, f.name)
        entry_field = rest[0]
        if entry_field.name == "key":
            entries[MARK] = entries.get("x", "") if entry_field.type == FieldDescriptor.TYPE_STRING else 0
        elif len(rest) == 1:
            entries["k"] = MARK
        else:
            set_string(entries["k"], rest[1:])
        return
    if not rest:
        if f.is_repeated:
            getattr(msg, f.name).append(MARK)
        else:
            setattr(msg, f.name, MARK)
        return
    set_string(getattr(msg, f.name).add() if f.is_repeated else getattr(msg, f.name), rest)


def malformed(message_class: type[Message], path: Path) -> bytes:
    msg = message_class()
    set_string(msg, path)
    data = msg.SerializeToString()
    assert data.count(MARK.encode()) == 1
    data = data.replace(MARK.encode(), BAD)
    with pytest.raises(DecodeError):
        message_class.FromString(data)
    return data


CASES = [(method, message_class, path) for method, message_class in
         (("Generate", generation_pb2.GenerateRequest), ("Tokenize", generation_pb2.TokenizeRequest),
          ("GenerateStream", generation_pb2.GenerateStreamRequest))
         for path in string_paths(message_class.DESCRIPTOR)]


def test_there_are_string_fields_to_check() -> None:
    names = {(m, ".".join(f.name for f in p)) for m, _, p in CASES}
    assert {("Generate", "text"), ("Generate", "chat.messages.content"), ("Generate", "request_id"),
            ("Tokenize", "text"), ("Generate", "trace_headers.key"), ("GenerateStream", "generate.text")} <= names
    assert len(CASES) > 20


def test_every_malformed_utf8_string_field_is_invalid_argument_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    tok = Tokenizer.from_pretrained(default_model_path())

    async def main() -> list[tuple[str, str, grpc.StatusCode, str]]:
        engine = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(InfoEngine(), engine)
        engine_port = engine.add_insecure_port("127.0.0.1:0")
        await engine.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}")
        server, _ = public_server(tok, MAX_MODEL_LEN, ())
        servicer = GenerationServicer(tok, channel, served_model_name="m")
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as client:
                generate = client.unary_stream("/sluice.v1.Generation/Generate")
                tokenize = client.unary_unary("/sluice.v1.Generation/Tokenize")
                streamed = client.stream_stream("/sluice.v1.Generation/GenerateStream")
                for method, message_class, path in CASES:
                    data = malformed(message_class, path)
                    try:
                        if method == "Generate":
                            async for _ in generate(data, timeout=30):
                                pass
                        elif method == "GenerateStream":  # the call's first message: the call ends naming it
                            async for _ in streamed(iter([data]), timeout=30):
                                pass
                        else:
                            await tokenize(data, timeout=30)
                        code, details = grpc.StatusCode.OK, ""
                    except grpc.aio.AioRpcError as e:
                        code, details = e.code(), e.details() or ""
                    out.append((method, ".".join(f.name for f in path), code, details))
        finally:
            await server.stop(None)
            await servicer.prompts.aclose()
            servicer.close()
            await channel.close()
            await engine.stop(None)
        return out

    with caplog.at_level(logging.ERROR):
        results = asyncio.run(main())
    names = {generation_pb2.GenerateRequest: "sluice.v1.GenerateRequest",
             generation_pb2.TokenizeRequest: "sluice.v1.TokenizeRequest",
             generation_pb2.GenerateStreamRequest: "sluice.v1.GenerateStreamRequest"}
    for (method, field, code, details), (_, message_class, _) in zip(results, CASES, strict=True):
        assert (method, field, code, details) == (
            method, field, grpc.StatusCode.INVALID_ARGUMENT,
            f"{field}: is not valid UTF-8 (a string field of {names[message_class]})")
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
