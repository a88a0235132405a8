"""What a model's files say about the largest request anyone may send for it, read before the model loads
(a gRPC server's receive limit is fixed when the server is built, and it is built first)."""

from __future__ import annotations

import json
from pathlib import Path

from common.grpc_server import MESSAGE_HEADROOM_BYTES
from common.model_context import DEFAULT_CONTEXT_LENGTH, declared_context

# A token id on the wire: a packed varint, at most 4 bytes below 2**28 (every vocabulary).
ID_WIRE_BYTES = 4


def model_context_length(model_path: str) -> int:
    """The model's context length (``max_position_embeddings``, times a dynamic-NTK rope's factor, or a GGUF's
    ``<arch>.context_length``): the most any engine serving it takes as ``max_model_len``. Raises OSError or
    ValueError naming the file."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        from engine.text.gguf_tokenizer import read_gguf_metadata

        def key(meta: dict[str, object]) -> str:
            return f"{meta.get('general.architecture')}.context_length"

        meta = read_gguf_metadata(model_path, until=lambda meta: key(meta) in meta)
        return int(meta.get(key(meta), DEFAULT_CONTEXT_LENGTH))  # type: ignore[call-overload]
    return declared_context(json.loads((path / "config.json").read_text()))


def engine_max_request_bytes(max_model_len: int) -> int:
    """The engine's receive limit: a prompt of ``max_model_len`` ids inline, and room for the other fields."""
    return max_model_len * ID_WIRE_BYTES + MESSAGE_HEADROOM_BYTES
