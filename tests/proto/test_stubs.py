"""The committed stubs match the .proto files; the contracts have the agreed shape."""

from __future__ import annotations

import re
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from proto import generate
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc

PROTO_ROOT = generate.PROTO_ROOT


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    committed = generate.generated_files(PROTO_ROOT)
    assert [p.name for p in fresh] == [p.name for p in committed]
    assert [p.name for p in fresh] == [
        "common_pb2.py", "common_pb2.pyi", "common_pb2_grpc.py",
        "engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py",
        "generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py",
    ]
    stale = [c.name for f, c in zip(fresh, committed) if f.read_bytes() != c.read_bytes()]
    assert not stale, f"stubs drifted from the .proto files: {stale}; run `python -m proto.generate`"


def test_generation_removes_stubs_of_deleted_protos(tmp_path: Path) -> None:
    leftover = tmp_path / "sluice" / "v1" / "gone_pb2.py"
    leftover.parent.mkdir(parents=True)
    leftover.write_text("stale")
    generate.generate(tmp_path)
    assert not leftover.exists()


def test_stubs_use_package_imports() -> None:
    for path in generate.generated_files(PROTO_ROOT):
        text = path.read_text()
        assert not re.search(r"^(from|import) sluice\b", text, re.MULTILINE), path.name
    assert "from proto.sluice.v1 import common_pb2" in (PROTO_ROOT / "sluice/v1/engine_pb2.py").read_text()
    assert "from proto.sluice.v1 import engine_pb2" in (PROTO_ROOT / "sluice/v1/engine_pb2_grpc.py").read_text()


def test_fix_imports_rewrites_both_import_forms() -> None:
    src = "from sluice.v1 import common_pb2 as c\nimport sluice.v1.engine_pb2\n# from sluice.v1 import x\n"
    assert generate.fix_imports(src) == (
        "from proto.sluice.v1 import common_pb2 as c\nimport proto.sluice.v1.engine_pb2\n# from sluice.v1 import x\n")


def _methods(module: object, service: str) -> dict[str, tuple[str, str, bool, bool]]:
    desc = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return {m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
            for m in desc.methods}


def test_engine_service_methods() -> None:
    assert engine_pb2.DESCRIPTOR.package == "sluice.v1"
    assert _methods(engine_pb2, "Engine") == {
        "Generate": ("EngineGenerateRequest", "EngineGenerateResponse", False, True),
        "Stream": ("EngineStreamRequest", "EngineStreamResponse", True, True),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "GetInfo": ("GetInfoRequest", "GetInfoResponse", False, False),
        "RegisterSharedMemory": ("RegisterSharedMemoryRequest", "RegisterSharedMemoryResponse", False, False),
        "LoadLoRAAdapter": ("LoadLoRAAdapterRequest", "LoadLoRAAdapterResponse", False, False),
        "UnloadLoRAAdapter": ("UnloadLoRAAdapterRequest", "UnloadLoRAAdapterResponse", False, False),
        "Pool": ("EnginePoolRequest", "EnginePoolResponse", False, False),
        "ResetPrefixCache": ("ResetPrefixCacheRequest", "ResetPrefixCacheResponse", False, False),
    }
    for name in ("EngineStub", "EngineServicer", "add_EngineServicer_to_server"):
        assert hasattr(engine_pb2_grpc, name), name


def test_generation_service_methods() -> None:
    assert _methods(generation_pb2, "Generation") == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True),
        "GenerateStream": ("GenerateStreamRequest", "GenerateStreamResponse", True, True),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False, False),
        "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False, False),
        "ApplyChatTemplate": ("ApplyChatTemplateRequest", "ApplyChatTemplateResponse", False, False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False, False),
        "LoadLoRAAdapter": ("LoadLoRAAdapterRequest", "LoadLoRAAdapterResponse", False, False),
        "UnloadLoRAAdapter": ("UnloadLoRAAdapterRequest", "UnloadLoRAAdapterResponse", False, False),
        "Embed": ("EmbedRequest", "EmbedResponse", False, False),
        "Score": ("ScoreRequest", "ScoreResponse", False, False),
        "Classify": ("ClassifyRequest", "ClassifyResponse", False, False),
        "ResetPrefixCache": ("ResetPrefixCacheRequest", "ResetPrefixCacheResponse", False, False),
    }
    for name in ("GenerationStub", "GenerationServicer", "add_GenerationServicer_to_server"):
        assert hasattr(generation_pb2_grpc, name), name


def test_finish_reasons_are_the_agreed_ones() -> None:
    assert [v.name for v in common_pb2.FinishReason.DESCRIPTOR.values] == [
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_EOS",
        "FINISH_REASON_STOP_STRING", "FINISH_REASON_ABORTED", "FINISH_REASON_TIME_LIMIT",
        "FINISH_REASON_ERROR", "FINISH_REASON_TOOL_CALLS",
    ]
    assert common_pb2.FINISH_REASON_UNSPECIFIED == 0


def test_prompt_oneofs() -> None:
    def oneof(message: type, name: str) -> list[str]:
        return [f.name for f in message.DESCRIPTOR.oneofs_by_name[name].fields]  # type: ignore[attr-defined]

    assert oneof(generation_pb2.GenerateRequest, "input") == ["text", "chat", "token_ids"]
    assert oneof(engine_pb2.EngineGenerateRequest, "prompt") == ["prompt_token_ids", "prompt_shm"]
    assert oneof(generation_pb2.GenerateResponse, "stop_reason") == ["stop_string", "stop_token_id"]
    request = generation_pb2.GenerateRequest(text="hi")
    request.token_ids.ids.extend([1, 2])
    assert request.WhichOneof("input") == "token_ids" and request.text == ""


def test_presence_where_zero_is_meaningful() -> None:
    sampling = common_pb2.SamplingParameters()
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty"):
        assert not sampling.HasField(name), name
    sampling.temperature = 0.0
    sampling.seed = 0
    assert sampling.HasField("temperature") and sampling.HasField("seed")
    assert common_pb2.SamplingParameters.FromString(sampling.SerializeToString()).HasField("temperature")
    stopping = generation_pb2.StoppingCriteria()
    assert not stopping.HasField("max_tokens") and not stopping.HasField("time_limit_ms")
    assert not generation_pb2.ResponseOptions().HasField("skip_special_tokens")
    assert not engine_pb2.EngineGenerateRequest().HasField("logprobs")


def test_token_ids_are_packed() -> None:
    ids = common_pb2.TokenIds(ids=[1, 2, 3])
    # Packed: one tag, one length, then 1 byte per small id (unpacked would repeat the tag).
    assert ids.SerializeToString() == b"\x0a\x03\x01\x02\x03"


def test_guided_decoding_is_one_oneof_shared_by_both_services() -> None:
    desc = common_pb2.GuidedDecoding.DESCRIPTOR
    assert [f.name for f in desc.oneofs_by_name["kind"].fields] == [
        "json_schema", "json_object", "regex", "choice", "grammar"]
    assert generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["guided"].message_type is desc
    assert engine_pb2.EngineGenerateRequest.DESCRIPTOR.fields_by_name["guided"].message_type is desc


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "set.pb"
    generate.run_protoc([f"--proto_path={PROTO_ROOT}", f"--proto_path={generate.well_known_protos_dir()}",
                         f"--descriptor_set_out={out}", "--include_source_info",
                         *map(str, generate.proto_files())])
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _documented_paths(fd: descriptor_pb2.FileDescriptorProto) -> set[tuple[int, ...]]:
    return {tuple(loc.path) for loc in fd.source_code_info.location
            if loc.leading_comments.strip() or loc.trailing_comments.strip()}


def _elements(fd: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Path in the source info (descriptor.proto field numbers) -> name, for every element."""
    found: dict[tuple[int, ...], str] = {}

    def enum(e: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...]) -> None:
        found[path] = e.name
        for i, v in enumerate(e.value):
            found[path + (2, i)] = f"{e.name}.{v.name}"

    def message(m: descriptor_pb2.DescriptorProto, path: tuple[int, ...]) -> None:
        found[path] = m.name
        for i, f in enumerate(m.field):
            found[path + (2, i)] = f"{m.name}.{f.name}"
        for i, o in enumerate(m.oneof_decl):
            if not o.name.startswith("_"):  # synthetic oneofs of `optional` fields have no source
                found[path + (8, i)] = f"{m.name}.{o.name}"
        for i, n in enumerate(m.nested_type):
            if not n.options.map_entry:  # synthetic entry type of a `map<,>` field
                message(n, path + (3, i))
        for i, e in enumerate(m.enum_type):
            enum(e, path + (4, i))

    for i, m in enumerate(fd.message_type):
        message(m, (4, i))
    for i, e in enumerate(fd.enum_type):
        enum(e, (5, i))
    for i, s in enumerate(fd.service):
        found[(6, i)] = s.name
        for j, r in enumerate(s.method):
            found[(6, i, 2, j)] = f"{s.name}.{r.name}"
    return found


def test_every_element_is_documented(tmp_path: Path) -> None:
    files = _descriptor_set(tmp_path).file
    assert [f.name for f in files] == ["sluice/v1/common.proto", "sluice/v1/engine.proto",
                                       "sluice/v1/generation.proto"]
    for fd in files:
        assert fd.package == "sluice.v1" and fd.syntax == "proto3"
        elements = _elements(fd)
        undocumented = sorted(name for path, name in elements.items() if path not in _documented_paths(fd))
        assert not undocumented, f"{fd.name}: undocumented {undocumented}"
        assert len(elements) > 10


def test_enum_values_are_prefixed_with_their_type(tmp_path: Path) -> None:
    for fd in _descriptor_set(tmp_path).file:
        for enum in fd.enum_type:
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
            assert all(v.name.startswith(prefix) for v in enum.value), enum.name
            assert enum.value[0].number == 0 and enum.value[0].name == prefix + "UNSPECIFIED"


def test_imports_resolve_from_the_proto_root() -> None:
    # Node's @grpc/proto-loader gets includeDirs=[proto/]: every import must lie under it.
    for rel in generate.proto_files():
        text = (PROTO_ROOT / rel).read_text()
        assert text.count('syntax = "proto3";') == 1
        for imported in re.findall(r'^import\s+"([^"]+)";', text, re.MULTILINE):
            assert (PROTO_ROOT / imported).is_file(), f"{rel}: import {imported!r} not under proto/"


class _FakeEngine(engine_pb2_grpc.EngineServicer):
    def Generate(self, request: engine_pb2.EngineGenerateRequest, context: grpc.ServicerContext):  # type: ignore[override]
        prompt = list(request.prompt_token_ids.ids)
        for i, token in enumerate(prompt[::-1]):
            last = i == len(prompt) - 1
            yield engine_pb2.EngineGenerateResponse(
                token_ids=[token], prompt_tokens=len(prompt),
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED)


@pytest.fixture
def engine_channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_EngineServicer_to_server(_FakeEngine(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(None)


def test_stubs_carry_a_stream_over_a_real_server(engine_channel: grpc.Channel) -> None:
    stub = engine_pb2_grpc.EngineStub(engine_channel)
    request = engine_pb2.EngineGenerateRequest(request_id="r", prompt_token_ids=common_pb2.TokenIds(ids=[5, 6, 7]))
    replies = list(stub.Generate(request, timeout=10))
    assert [list(r.token_ids) for r in replies] == [[7], [6], [5]]
    assert [r.finish_reason for r in replies] == [0, 0, common_pb2.FINISH_REASON_LENGTH]
    assert {r.prompt_tokens for r in replies} == {3}
    with pytest.raises(grpc.RpcError) as err:
        stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
