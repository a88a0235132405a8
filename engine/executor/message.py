"""The driver → worker messages, typed (msgspec structs encoded as MessagePack; never pickle).

A message is one of :class:`InitCache` (the KV cache's block count, decided on the driver, once), :class:`Execute`
(a step's :class:`~engine.worker.step_inputs.StepInputs`) or :class:`Shutdown`, tagged by ``kind``. Arrays travel
as raw little-endian int64 bytes, so any MessagePack reader decodes a message into maps, lists, integers and byte
strings (``msgspec.msgpack.decode(data)`` without a type, or the ``msgpack`` package), and :data:`SCHEMA` is its
JSON Schema.
"""
from __future__ import annotations

import msgspec
import numpy as np

from engine.config import EngineConfig
from engine.worker.step_inputs import MicroBatch, StepInputs


class WireMicroBatch(msgspec.Struct, array_like=False):
    token_start: int
    token_end: int
    query_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    num_seqs: int
    max_blocks: int
    block_tables: bytes        # int64 little-endian, [num_seqs, max_blocks] row-major


class InitCache(msgspec.Struct, tag_field="kind", tag="init_cache"):
    """Allocate the KV cache: every rank has the same block ids."""

    num_blocks: int


class Execute(msgspec.Struct, tag_field="kind", tag="execute"):
    """Run one step's forward pass (and the logits gathers) over these inputs."""

    input_ids: bytes           # int64 little-endian [num_tokens]
    positions: bytes           # int64 little-endian [num_tokens]
    slot_mapping: bytes        # int64 little-endian [num_tokens]
    block_size: int
    micro_batches: list[WireMicroBatch]
    block_copies: list[tuple[int, int]]
    logits_rows: list[bytes]   # each int64 little-endian


class Shutdown(msgspec.Struct, tag_field="kind", tag="shutdown"):
    """Leave the step loop and the process group; the process exits 0."""


WorkerMessage = InitCache | Execute | Shutdown

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WorkerMessage)
SCHEMA = msgspec.json.schema(WorkerMessage)


def _i64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def _arr(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<i8").astype(np.int64)


def encode_step(inputs: StepInputs) -> bytes:
    mbs = [WireMicroBatch(mb.token_start, mb.token_end, list(mb.query_lens), list(mb.seq_lens), mb.num_decodes,
                          int(mb.block_tables.shape[0]), int(mb.block_tables.shape[1]), _i64(mb.block_tables))
           for mb in inputs.micro_batches]
    return _ENCODER.encode(Execute(_i64(inputs.input_ids), _i64(inputs.positions), _i64(inputs.slot_mapping),
                                   inputs.block_size, mbs, [(int(s), int(d)) for s, d in inputs.block_copies],
                                   [_i64(r) for r in inputs.logits_rows]))


def encode_shutdown() -> bytes:
    return _ENCODER.encode(Shutdown())


def encode_init_cache(num_blocks: int) -> bytes:
    return _ENCODER.encode(InitCache(num_blocks))


def decode(data: bytes) -> StepInputs | InitCache | None:
    """A step's inputs, the :class:`InitCache` message, or None for :class:`Shutdown`."""
    msg = _DECODER.decode(data)
    if isinstance(msg, Shutdown):
        return None
    if isinstance(msg, InitCache):
        return msg
    mbs = [MicroBatch(m.token_start, m.token_end, m.query_lens, m.seq_lens, m.num_decodes,
                      _arr(m.block_tables).reshape(m.num_seqs, m.max_blocks)) for m in msg.micro_batches]
    return StepInputs(_arr(msg.input_ids), _arr(msg.positions), _arr(msg.slot_mapping), msg.block_size, mbs,
                      [(s, d) for s, d in msg.block_copies], [_arr(r) for r in msg.logits_rows])


def encode_config(config: EngineConfig) -> str:
    """The engine's config as JSON, for the command line or the actor that starts another rank."""
    return msgspec.json.encode(config).decode()


def decode_config(text: str) -> EngineConfig:
    """The config ``encode_config`` wrote, validated again."""
    return msgspec.json.decode(text, type=EngineConfig)
