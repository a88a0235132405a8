"""EngineGenerateRequest.guided: each oneof kind converted to StructuredOutputsParams, refusals naming the proto's
field, and a constraint that does not compile refused with INVALID_ARGUMENT by a running server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import StructuredOutputsParams
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.grpc_servicer import sampling_params_from_pb, wire_error
from engine.text import Tokenizer
from engine.worker.structured_output import GrammarVocabulary
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.engine.entrypoints.test_grpc_servicer import Outbox, _gen, _request, serve


def _guided(**kind: Any) -> engine_pb2.EngineGenerateRequest:
    return _request("r", [1, 2, 3], 8, guided=common_pb2.GuidedDecoding(**kind))


@pytest.mark.parametrize("kind, expected", [
    ({"json_schema": '{"type": "object"}'}, StructuredOutputsParams(json='{"type": "object"}')),
    ({"json_object": True}, StructuredOutputsParams(json_object=True)),
    ({"regex": "[a-z]+"}, StructuredOutputsParams(regex="[a-z]+")),
    ({"choice": common_pb2.Choices(choices=["yes", "no"])}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_each_guided_kind_becomes_structured_outputs(kind: dict[str, Any], expected: StructuredOutputsParams) -> None:
    assert sampling_params_from_pb(_guided(**kind)).structured_outputs == expected


def test_no_guided_decoding_is_no_constraint() -> None:
    assert sampling_params_from_pb(_request("r", [1], 4)).structured_outputs is None


@pytest.mark.parametrize("kind, field", [
    ({"json_schema": "{oops"}, "guided.json_schema"),
    ({"json_object": False}, "guided.json_object"),
    ({"regex": ""}, "guided.regex"),
    ({"choice": common_pb2.Choices()}, "guided.choice"),
    ({"grammar": "x" * (64 * 1024 + 1)}, "guided.grammar"),
])
def test_refusals_name_the_guided_field(kind: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        sampling_params_from_pb(_guided(**kind))
    assert e.value.field == field


def test_wire_error_renames_only_structured_outputs_fields() -> None:
    renamed = wire_error(InvalidRequestError("structured_outputs.json", "does not compile"))
    assert isinstance(renamed, InvalidRequestError)
    assert (renamed.field, renamed.message) == ("guided.json_schema", "does not compile")
    other = InvalidRequestError("temperature", "must be >= 0")
    assert wire_error(other) is other


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    config = EngineConfig(dtype="float32", kv_cache_memory=64 * 2**20, num_threads=1)
    vocabulary = GrammarVocabulary.from_tokenizer(Tokenizer.from_pretrained(config.model_path))
    eng = AsyncEngine(EngineCore(config, grammar_vocabulary=vocabulary))
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_the_server_constrains_and_refuses_what_does_not_compile(engine: AsyncEngine) -> None:
    tokenizer = Tokenizer.from_pretrained(EngineConfig().model_path)

    async def scenario(stub: engine_pb2_grpc.EngineStub, eng: AsyncEngine) -> Any:
        choice = _request("ok", [1, 2, 3], 8, guided=common_pb2.GuidedDecoding(
            choice=common_pb2.Choices(choices=["alpha", "beta"])))
        ok = [m async for m in stub.Generate(choice)]
        try:
            [m async for m in stub.Generate(_request("bad", [1, 2, 3], 8,
                                                     guided=common_pb2.GuidedDecoding(regex="([0-9]")))]
        except grpc.aio.AioRpcError as e:
            refused = (e.code(), e.details())
        outbox = Outbox()
        outbox.send(_gen(_request("bad2", [1, 2, 3], 8,
                                  guided=common_pb2.GuidedDecoding(json_schema='{"type": "strin"}'))))
        outbox.close()
        stream = [m async for m in stub.Stream(outbox)]
        info = await eng.call(lambda core: core.info())
        return ok, refused, stream, info

    ok, refused, stream, info = serve(engine, scenario)
    tokens = [t for m in ok for t in m.token_ids]
    assert tokenizer.decode(tokens) in ("alpha", "beta")
    assert ok[-1].finish_reason == common_pb2.FINISH_REASON_EOS  # the grammar completed (ignore_eos was set)
    assert refused[0] == grpc.StatusCode.INVALID_ARGUMENT and refused[1].startswith("guided.regex: ")
    errors = [e for m in stream for e in m.errors]
    assert [(e.request_id, e.code) for e in errors] == [("bad2", grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert errors[0].message.startswith("guided.json_schema: ")
    assert info["free_kv_blocks"] == info["total_kv_blocks"] and info["num_waiting"] == 0
