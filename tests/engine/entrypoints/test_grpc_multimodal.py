"""The token-level proto's multimodal items as the engine core's: tensors inline and in shared memory, the
refusals naming the field, and images through the engine's gRPC servicer against transformers."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from common.errors import InvalidRequestError
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.grpc_multimodal import items_from_pb, tensor_from_pb
from engine.text.multimodal import MultiModalProcessor, ProcessedPrompt
from proto.shm import ShmRing
from proto.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.engine.entrypoints.test_grpc_servicer import serve
from tests.engine.models.llava_factory import IMAGE_TOKEN_ID, save_tiny_llava


def _item(tensors: dict[str, engine_pb2.TensorData]) -> engine_pb2.MultiModalItem:
    item = engine_pb2.MultiModalItem(modality="image", offset=3, length=16, hash="ab" * 32)
    for name, t in tensors.items():
        item.tensors[name].CopyFrom(t)
    return item


def test_inline_tensors_keep_dtype_shape_and_values() -> None:
    pixels = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4) / 7
    sizes = np.array([[30, 80]], dtype=np.int64)
    item = _item({"pixel_values": engine_pb2.TensorData(dtype="float32", shape=[1, 2, 3, 4], inline=pixels.tobytes()),
                  "image_sizes": engine_pb2.TensorData(dtype="int64", shape=[1, 2], inline=sizes.tobytes())})
    (got,) = items_from_pb([item])
    assert (got.modality, got.offset, got.length, got.hash) == ("image", 3, 16, "ab" * 32)
    assert torch.equal(got.tensors["pixel_values"], torch.from_numpy(pixels))
    assert torch.equal(got.tensors["image_sizes"], torch.from_numpy(sizes))
    bf16 = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    raw = bf16.view(torch.int16).numpy().tobytes()
    assert torch.equal(tensor_from_pb(engine_pb2.TensorData(dtype="bfloat16", shape=[3], inline=raw), "t", None), bf16)


def test_shared_memory_tensors_read_their_units() -> None:
    """Three float16 values take two 4-byte units: the padding of the last one is dropped."""
    values = np.array([0.5, 1.0, -4.0], dtype=np.float16)
    units = np.frombuffer(values.tobytes() + b"\0\0", dtype=np.int32)
    seen: list[engine_pb2.SharedMemoryRef] = []

    def read(ref: engine_pb2.SharedMemoryRef) -> np.ndarray:
        seen.append(ref)
        return units

    ref = engine_pb2.SharedMemoryRef(segment="seg", offset=10, length=2, slot=1)
    got = tensor_from_pb(engine_pb2.TensorData(dtype="float16", shape=[3], shm=ref), "t", read)
    assert torch.equal(got, torch.from_numpy(values))
    assert seen == [ref]


@pytest.mark.parametrize("data, field, message", [
    (engine_pb2.TensorData(dtype="float64", shape=[1], inline=b"\0" * 8), "tensors['pixel_values'].dtype",
     "not one of"),
    (engine_pb2.TensorData(dtype="float32", shape=[2, 3], inline=b"\0" * 20), "tensors['pixel_values'].inline",
     "20 bytes for shape"),
    (engine_pb2.TensorData(dtype="float32", shape=[2]), "tensors['pixel_values']", "inline or shm is required"),
    (engine_pb2.TensorData(dtype="float32", shape=[2], shm=engine_pb2.SharedMemoryRef(segment="s", length=2)),
     "tensors['pixel_values'].shm", "no shared memory"),
])
def test_bad_tensors_are_refused_naming_the_field(data: engine_pb2.TensorData, field: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as e:
        items_from_pb([_item({"pixel_values": data})])
    assert e.value.field == f"multi_modal_items[0].{field}"


# -- through the engine's gRPC servicer, in process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AsyncEngine, MultiModalProcessor, Any]]:
    path = tmp_path_factory.mktemp("llava")
    model = save_tiny_llava(path)
    engine = AsyncEngine(EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=48, num_threads=1)))
    yield engine, MultiModalProcessor(str(path), IMAGE_TOKEN_ID), model
    engine.shutdown()


def _generate_request(rid: str, processed: ProcessedPrompt, ring: ShmRing | None = None
                      ) -> engine_pb2.EngineGenerateRequest:
    """The processor's prompt and images as the tokenizer service is to send them: tensors inline, or in the
    shared-memory ring when one is given."""
    req = engine_pb2.EngineGenerateRequest(request_id=rid, sampling=common_pb2.SamplingParameters(temperature=0.0),
                                           stopping=engine_pb2.EngineStoppingCriteria(max_tokens=6))
    req.prompt_token_ids.ids.extend(processed.prompt_token_ids)
    for it in processed.items:
        item = req.multi_modal_items.add(modality=it.modality, offset=it.offset, length=it.length, hash=it.hash)
        for name, array in it.tensors.items():
            data = engine_pb2.TensorData(dtype=str(array.dtype), shape=list(array.shape))
            if ring is None:
                data.inline = array.tobytes()
            else:
                raw = array.tobytes()
                units = np.frombuffer(raw + b"\0" * (-len(raw) % 4), dtype=np.int32)
                # ShmRing.put takes token ids only (a tensor writer comes with the serving path): reserve a slot,
                # then fill it with the tensor's bytes
                ref = ring.put(np.zeros(len(units), dtype=np.int32))
                assert ref is not None
                ring._ids[ref.offset:ref.offset + ref.length] = units
                data.shm.CopyFrom(engine_pb2.SharedMemoryRef(segment=ref.segment, offset=ref.offset,
                                                             length=ref.length, slot=ref.slot))
            item.tensors[name].CopyFrom(data)
    return req


def _reference(model: Any, processed: ProcessedPrompt) -> list[int]:
    ids = torch.tensor([processed.prompt_token_ids])
    pixels = torch.cat([torch.from_numpy(it.tensors["pixel_values"]) for it in processed.items])
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=6, do_sample=False)
    return list(out[0, ids.shape[1]:].tolist())


@pytest.mark.slow
def test_generate_with_images_inline_and_in_shared_memory(llava: tuple[AsyncEngine, MultiModalProcessor, Any]
                                                          ) -> None:
    engine, processor, model = llava
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((50, 30), (24, 60))]
    processed = processor.process("USER: <image>\nw5 <image>\nw6 ASSISTANT:", images)
    ring = ShmRing(1 << 16)

    async def scenario(stub: engine_pb2_grpc.EngineStub, _: AsyncEngine) -> tuple[list[int], list[int], str]:
        registered = await stub.RegisterSharedMemory(engine_pb2.RegisterSharedMemoryRequest(
            segment=ring.name, size_bytes=ring.size_bytes))
        assert registered.ok, registered.error
        tokens = []
        for rid, shm in (("inline", None), ("shm", ring)):
            got: list[int] = []
            async for msg in stub.Generate(_generate_request(rid, processed, shm)):
                got += list(msg.token_ids)
            tokens.append(got)
        bad = _generate_request("bad", processed)
        bad.multi_modal_items[0].offset += 1   # its span no longer covers placeholders only
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(bad):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return tokens[0], tokens[1], e.value.details() or ""

    try:
        inline, shm, error = serve(engine, scenario)
    finally:
        ring.close()
    assert inline == shm == _reference(model, processed)
    assert "multi_modal_data" in error and "image placeholder" in error
    block_manager = engine.core.scheduler.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks
