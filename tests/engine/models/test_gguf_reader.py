"""engine.models.gguf_loader.ModelReader against gguf's own GGUFReader: the same fields (but arrays of strings,
which it skips), the same tensors, the same model config, without a view per array element."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from engine.models.gguf_loader import ModelReader, tensor_to_numpy

VOCAB = 3000   # enough strings that a per-element walk would show, small enough to write at once


def _write(path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_uint32("llama.embedding_length", 64)
    writer.add_token_list([f"tok{i}" for i in range(VOCAB)])
    writer.add_token_types([i % 5 for i in range(VOCAB)])
    writer.add_token_scores([i / VOCAB for i in range(VOCAB)])
    writer.add_token_merges([f"t o{i}" for i in range(VOCAB // 2)])
    writer.add_array("test.nested", [[1, 2], [3, 4, 5]])
    writer.add_string("general.name", "tiny")
    writer.add_tensor("q8", quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("f32", rng.standard_normal((3, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_fields_and_tensors_are_gguf_readers_without_the_string_arrays(tmp_path: Path) -> None:
    _write(tmp_path / "t.gguf")
    ours, theirs = ModelReader(str(tmp_path / "t.gguf")), GGUFReader(str(tmp_path / "t.gguf"))
    string_arrays = {name for name, f in theirs.fields.items()
                     if f.types == [GGUFValueType.ARRAY, GGUFValueType.STRING]}
    assert string_arrays == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}
    assert set(ours.fields) == set(theirs.fields) - string_arrays
    for name, field in ours.fields.items():
        assert (field.types, field.contents()) == (theirs.fields[name].types, theirs.fields[name].contents()), name
    assert ours.fields["tokenizer.ggml.token_type"].contents() == [i % 5 for i in range(VOCAB)]
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(tensor_to_numpy(a), tensor_to_numpy(b))

