"""The token-level proto's images (``EngineGenerateRequest.multi_modal_items``) as the engine core's
``MultiModalItem``s: each tensor read from its inline bytes or from the request's shared-memory segment, typed and
shaped as the message says."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from common.errors import InvalidRequestError
from engine.core.multimodal import MultiModalItem
from proto.sluice.v1 import engine_pb2

# TensorData.dtype's values.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int32": torch.int32}
# Reads a shared-memory reference's 4-byte units (the servicer's registered segments).
ShmRead = Callable[[engine_pb2.SharedMemoryRef], np.ndarray]


def tensor_from_pb(data: engine_pb2.TensorData, where: str, read_shm: ShmRead | None) -> torch.Tensor:
    """One TensorData as a tensor (a private copy). InvalidRequestError naming ``where`` for an unknown dtype, a
    negative dimension, a byte count that does not match the shape, or no data."""
    dtype = DTYPES.get(data.dtype)
    if dtype is None:
        raise InvalidRequestError(f"{where}.dtype", f"{data.dtype!r} is not one of {', '.join(DTYPES)}")
    shape = tuple(int(d) for d in data.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"{where}.shape", f"negative dimension in {list(shape)}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    which = data.WhichOneof("data")
    if which == "inline":
        raw = data.inline
        if len(raw) != nbytes:
            raise InvalidRequestError(f"{where}.inline", f"{len(raw)} bytes for shape {list(shape)} of "
                                                         f"{data.dtype} ({nbytes} bytes)")
    elif which == "shm":
        if read_shm is None:
            raise InvalidRequestError(f"{where}.shm", "no shared memory is registered")
        units = read_shm(data.shm)
        raw = units.tobytes()
        if len(raw) < nbytes or len(raw) - nbytes >= 4:
            raise InvalidRequestError(f"{where}.shm", f"{data.shm.length} 4-byte units for shape {list(shape)} of "
                                                      f"{data.dtype} ({nbytes} bytes)")
        raw = raw[:nbytes]
    else:
        raise InvalidRequestError(where, "one of inline or shm is required")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def items_from_pb(items: Sequence[engine_pb2.MultiModalItem], read_shm: ShmRead | None = None
                  ) -> tuple[MultiModalItem, ...]:
    """The request's items, in its order (the core checks them against the prompt and the model)."""
    out = []
    for i, item in enumerate(items):
        where = f"multi_modal_items[{i}]"
        tensors = {name: tensor_from_pb(t, f"{where}.tensors[{name!r}]", read_shm) for name, t in item.tensors.items()}
        out.append(MultiModalItem(item.modality, int(item.offset), int(item.length), item.hash, tensors))
    return tuple(out)
